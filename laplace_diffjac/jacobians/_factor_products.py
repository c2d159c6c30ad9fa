"""Products with the Jacobian from its per-layer factors: ``J v`` and ``diag(Jᵀ Λ J)``.

The context posterior needs, besides Grams (:mod:`laplace_diffjac.kernels`), two
products of a batch's Jacobians ``J`` ``(B, V, P)``: the Jacobian-vector product
``J v`` ``(B, V)`` (the dual mean's linearisation) and the GGN diagonal
``Σ_b diag(J_bᵀ Λ_b J_b)`` ``(P,)`` (the evidence's trace term). Both are computed
per parameter from the factors of :mod:`._assembly`, without writing ``J``:

``Product``  ``J v``: ``Σ_{o,l} g[b,v,o,l] (a[b,l,:] · v[o,:])``; the diagonal in
             closed form without tokens (``L = 1``): ``Σ_b q[b,o] a[b,k]²`` with
             ``q[b,o] = Σ_{v,w} g[b,v,o] Λ[b,v,w] g[b,w,o]``; over tokens or
             positions by the cheaper of its rows and its position Grams
             (:mod:`._position_diagonal`)
``Summed``   both in closed form from the summed signals
``Scattered`` ``J v`` gathers the looked-up rows of ``v``
``Dense``    the block is given: contract it

Where no closed form is written (``Scattered``, a parameter used by several module
calls), the diagonal contracts that one
parameter's block, written for a few samples at a time so that it never holds
more than ``_BLOCK_BYTES``. Everything is ordinary autograd on the factors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ._assembly import Dense, Factors, Product, Scattered, Summed, assemble
from ._engine import JacobianFactors
from ._position_diagonal import product_diagonal

__all__ = ["factor_ggn_diagonal", "factor_jvp", "parameter_blocks"]

#: Largest block (bytes) that the diagonal's block route writes at once.
_BLOCK_BYTES = 64 * 2**20


def factor_jvp(
    parts: JacobianFactors, params: Sequence[torch.Tensor], vector: torch.Tensor
) -> torch.Tensor:
    """``J v`` from the factors.

    Parameters
    ----------
    parts : JacobianFactors
        Factors of ``B`` samples, ``V`` rows.
    params : sequence of torch.Tensor
        The parameters in the Jacobian's column order.
    vector : torch.Tensor
        ``(P,)`` in that column order.

    Returns
    -------
    torch.Tensor
        ``(B, V)`` in the promoted dtype of the factors and ``vector``.

    """
    dtype = torch.promote_types(parts.f.dtype, vector.dtype)
    total = torch.zeros(parts.batch, parts.n_rows, dtype=dtype, device=parts.f.device)
    start = 0
    for p in params:
        size = p.numel()
        v = vector[start : start + size]
        start += size
        for entry in parts.factors.get(id(p), []):
            total = total + _entry_jvp(entry, v)
    return total


def _entry_jvp(entry: Factors, v: torch.Tensor) -> torch.Tensor:
    """``J_p v_p`` ``(B, V)`` of one factor entry and its parameter's slice."""
    if isinstance(entry, Product):
        n_out, width = entry.g.shape[2], entry.a.shape[2]
        if entry.transposed:
            rows = v.reshape(width, n_out).T
        else:
            rows = v.reshape(n_out, width)
        av = torch.einsum("blk,ok->bol", entry.a, rows)
        return torch.einsum("bvol,bol->bv", entry.g, av)
    if isinstance(entry, Summed):
        return torch.einsum("vbo,o->bv", entry.g.sum(3), v)
    if isinstance(entry, Scattered):
        rows = v.reshape(-1, entry.g.shape[3])[entry.index]  # (B, L, K)
        return torch.einsum("vblk,blk->bv", entry.g, rows)
    assert isinstance(entry, Dense)
    return torch.einsum("vbn,n->bv", entry.block, v)


def factor_ggn_diagonal(
    parts: JacobianFactors,
    params: Sequence[torch.Tensor],
    lam: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Σ_b diag(J_bᵀ Λ_b J_b)`` from the factors.

    Parameters
    ----------
    parts : JacobianFactors
        Factors of ``B`` samples, ``V`` rows.
    params : sequence of torch.Tensor
        The parameters in the Jacobian's column order.
    lam : torch.Tensor, optional
        ``(B, V, V)`` symmetric output Hessians; the identity by default (rows
        that are already square roots of the Hessian: ``Σ_b Σ_v J_bv²``).

    Returns
    -------
    torch.Tensor
        ``(P,)`` in the promoted dtype of the factors and ``lam``.

    """
    dtype = parts.f.dtype
    if lam is not None:
        dtype = torch.promote_types(dtype, lam.dtype)
    device = parts.f.device
    blocks = []
    for p in params:
        entries = parts.factors.get(id(p), [])
        if not entries:
            blocks.append(torch.zeros(p.numel(), dtype=dtype, device=device))
        elif len(entries) == 1 and _has_closed_form(entries[0]):
            blocks.append(_entry_diagonal(entries[0], lam))
        else:
            blocks.append(_block_diagonal(parts, p, lam))
    if not blocks:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.cat([b.to(dtype) for b in blocks])


def _has_closed_form(entry: Factors) -> bool:
    return isinstance(entry, (Product, Summed, Dense))


def _entry_diagonal(entry: Factors, lam: torch.Tensor | None) -> torch.Tensor:
    """The closed forms of the module docstring, ``(n,)`` for one parameter."""
    if isinstance(entry, Product) and entry.g.shape[3] > 1:
        return product_diagonal(entry, lam)
    if isinstance(entry, Product):
        g = entry.g[..., 0]  # (B, V, out)
        if lam is None:
            q = g.square().sum(1)
        else:
            q = torch.einsum("bvo,bvw,bwo->bo", g, lam, g)
        diagonal = torch.einsum("bo,bk->ok", q, entry.a[:, 0].square())
        return (diagonal.T if entry.transposed else diagonal).reshape(-1)
    if isinstance(entry, Summed):
        s = entry.g.sum(3)  # (V, B, out)
        if lam is None:
            return s.square().sum((0, 1))
        return torch.einsum("vbo,bvw,wbo->o", s, lam, s)
    assert isinstance(entry, Dense)
    if lam is None:
        return entry.block.square().sum((0, 1))
    return torch.einsum("vbn,bvw,wbn->n", entry.block, lam, entry.block)


def parameter_blocks(
    parts: JacobianFactors, p: torch.Tensor
) -> Iterator[tuple[slice, torch.Tensor]]:
    """``p``'s Jacobian columns ``(b, V, numel)``, a few samples at a time.

    Yields
    ------
    samples : slice
        The samples of the chunk.
    block : torch.Tensor
        Their columns of ``J``, never more than ``_BLOCK_BYTES`` at once.

    """
    per_sample = max(1, parts.n_rows * p.numel() * parts.f.element_size())
    step = max(1, _BLOCK_BYTES // per_sample)
    for start in range(0, parts.batch, step):
        samples = slice(start, start + step)
        chunk = parts[samples]
        yield samples, assemble(chunk.factors, [p], chunk.n_rows, chunk.batch, chunk.f)


def _block_diagonal(
    parts: JacobianFactors, p: torch.Tensor, lam: torch.Tensor | None
) -> torch.Tensor:
    """``p``'s diagonal from its block, a few samples at a time."""
    dtype = parts.f.dtype if lam is None else lam.dtype
    total = torch.zeros(p.numel(), dtype=dtype, device=parts.f.device)
    for samples, J in parameter_blocks(parts, p):
        if lam is None:
            total = total + J.square().sum((0, 1)).to(total)
        else:
            lam_c = lam[samples].to(J.dtype)
            total = total + torch.einsum("bvn,bvw,bwn->n", J, lam_c, J).to(total)
    return total
