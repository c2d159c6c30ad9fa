"""The GGN diagonal of a layer applied at several positions, without its whole block.

A :class:`._assembly.Product` over ``L > 1`` positions (a convolution's output
positions, a Linear layer's tokens) has the per-sample Jacobian rows
``J[b, v, o, k] = Σ_l g[b, v, o, l] a[b, l, k]``, and its diagonal
``Σ_{b,v} J[b, v, o, k]²`` (or ``Σ_b diag(J_bᵀ Λ_b J_b)``) needs the squares of
the rows, not only the factors. Two routes give it exactly, chosen per layer by
what each costs:

rows
    ``J_b = g_b a_b`` written for a few samples at a time, each chunk small
    enough to stay in the processor's cache (``_CACHE_BYTES``), squared and
    summed; ``V·out·K`` written per sample, cheap for many positions.
position Gram
    ``Σ_b Σ_{l,m} Q[b, o, l, m] a[b, l, k] a[b, m, k]`` with
    ``Q[b, o, l, m] = Σ_{v,w} g[b, v, o, l] Λ[b, v, w] g[b, w, o, m]``: one
    matrix product ``(out, L²) × (L², K)`` per sample and nothing of size
    ``V·out·K``; cheap for few positions and many rows (the deep layers of a
    convolutional network, whose rows product is bound by memory traffic).

Both are ordinary autograd on the factors.
"""

from __future__ import annotations

import torch

from ._assembly import Product

__all__ = ["product_diagonal"]

#: Bytes of Jacobian rows (or of the Gram route's input products) written at once:
#: a chunk this size stays in cache between its write, its square and its sum.
_CACHE_BYTES = 2 * 2**20


def product_diagonal(entry: Product, lam: torch.Tensor | None) -> torch.Tensor:
    """``Σ_b diag(J_bᵀ Λ_b J_b)`` of one ``Product`` entry, in its column order.

    Parameters
    ----------
    entry : Product
        Signals ``g`` ``(B, V, out, L)`` and inputs ``a`` ``(B, L, K)``.
    lam : torch.Tensor, optional
        ``(B, V, V)`` symmetric output Hessians; the identity by default.

    Returns
    -------
    torch.Tensor
        ``(out·K,)``, ordered ``(K, out)`` for a ``TransposedProduct``.

    """
    g, a = entry.g, entry.a
    if lam is not None:
        dtype = torch.promote_types(g.dtype, lam.dtype)
        g, a, lam = g.to(dtype), a.to(dtype), lam.to(dtype)
    _, n_rows, n_out, positions = g.shape
    if _gram_is_cheaper(n_rows, n_out, positions, a.shape[2]):
        diagonal = _gram_diagonal(g, a, lam)
    else:
        diagonal = _rows_diagonal(g, a, lam)
    return (diagonal.T if entry.transposed else diagonal).reshape(-1)


def _gram_is_cheaper(rows: int, n_out: int, positions: int, width: int) -> bool:
    """Whether the position Gram costs less than writing the rows.

    The rows route multiplies ``V·out·L·K`` and writes, squares and sums
    ``V·out·K`` per sample (a few passes over memory); the Gram route
    multiplies ``out·L²·K`` and writes the ``L²·K`` input products.

    Returns
    -------
    bool

    """
    rows_cost = rows * n_out * width * (positions + 8)
    gram_cost = positions**2 * width * (n_out + 4) + rows * n_out * positions**2
    return gram_cost < rows_cost


def _step(per_sample_bytes: int) -> int:
    return max(1, _CACHE_BYTES // max(1, per_sample_bytes))


def _rows_diagonal(
    g: torch.Tensor, a: torch.Tensor, lam: torch.Tensor | None
) -> torch.Tensor:
    """``(out, K)`` from the rows ``J_b``, a few samples at a time."""
    batch, n_rows, n_out, positions = g.shape
    width = a.shape[2]
    total = g.new_zeros(n_out, width)
    step = _step(n_rows * n_out * width * g.element_size())
    for start in range(0, batch, step):
        gc, ac = g[start : start + step], a[start : start + step]
        J = torch.bmm(gc.reshape(gc.shape[0], n_rows * n_out, positions), ac)
        J = J.view(gc.shape[0], n_rows, n_out * width)
        if lam is None:
            total = total + J.square().sum((0, 1)).view(n_out, width)
        else:
            lam_c = lam[start : start + step]
            part = torch.einsum("bvn,bvw,bwn->n", J, lam_c, J)
            total = total + part.view(n_out, width)
    return total


def _gram_diagonal(
    g: torch.Tensor, a: torch.Tensor, lam: torch.Tensor | None
) -> torch.Tensor:
    """``(out, K)`` from the position Grams of the signals and the inputs."""
    batch, _, n_out, positions = g.shape
    width = a.shape[2]
    total = g.new_zeros(n_out, width)
    step = _step(positions**2 * width * a.element_size())
    for start in range(0, batch, step):
        gc, ac = g[start : start + step], a[start : start + step]
        weighted = (
            gc
            if lam is None
            else torch.einsum("bvw,bwol->bvol", lam[start : start + step], gc)
        )
        Q = torch.einsum("bvol,bvom->bolm", weighted, gc)
        Q = Q.reshape(gc.shape[0], n_out, positions**2)
        products = ac[:, :, None, :] * ac[:, None, :, :]  # (b, L, L, K)
        products = products.reshape(ac.shape[0], positions**2, width)
        total = total + torch.bmm(Q, products).sum(0)
    return total
