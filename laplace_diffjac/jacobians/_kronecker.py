"""Kronecker factors of the GGN from the engine's per-layer factors, for any model.

The engine differentiates rows ``s_bvᵀ f_b`` whose squares sum to the GGN
(:mod:`._loss_seeds`), and returns per-layer factors of their Jacobians
(:mod:`._assembly`). Each parameter's block of the GGN is approximated by laplace-
torch's ``Kron`` layout: one factor ``(n, n)`` for a one-dimensional parameter, two
factors ``F0 (m, m)``, ``F1 (n, n)`` for a parameter of shape ``(m, *rest)``
(``n = prod(rest)``), the block being ``F0 ⊗ F1``. Which approximation, by the
module that owns the parameter:

Convolutions (``Conv1d``/``Conv2d``, groups 1)
    BackPACK's ``KFLR``, as laplace-torch's ``BackPackGGN`` gives it: the signal
    factor ``G = Σ_b Σ_v ĝ ĝᵀ`` of the signals summed over output positions (the
    bias's exact block), the input factor ``A = Σ_b Σ_l a aᵀ / B`` of the
    unfolded patches.
Layers linear in their weight, shared over tokens
    ``nn.Linear``, Hugging Face's ``Conv1D``, ``nn.Embedding`` (one-hot inputs),
    ``nn.MultiheadAttention``'s projections, recurrent weights: KFAC in the two
    settings of Eschenhagen et al. (2023), as curvlinops computes them.
    *expand* treats the ``L`` tokens as samples, ``G = Σ_{b,v,l} g gᵀ``,
    ``A = Σ_{b,l} a aᵀ / (B L)``; *reduce* sums the signals and averages the
    inputs over tokens first, ``G = Σ_{b,v} ĝ ĝᵀ``, ``A = Σ_b ā āᵀ / B``. Biases
    are weights of input 1. Without tokens both are exact per sample and equal
    BackPACK's ``KFLR``.
Any other parameter
    The exact block ``Σ_b Σ_v ρ_bv ρ_bvᵀ`` (``ρ``: the parameter's Jacobian rows)
    when it has one factor or ``F0`` is ``1×1`` (norm weights, ViT's class token
    and position embeddings); otherwise the nearest Kronecker product of the exact
    block in the Frobenius norm (Van Loan and Pitsianis, 1993), found by
    alternating ``G ← Σ ρ A ρᵀ``, ``A ← Σ ρᵀ G ρ``.

In every case the first factor sums over the batch and the second averages (as
BackPACK's and curvlinops' factors do in laplace-torch), so that laplace-torch's
rescaling by ``M / N`` and its sum over batches give the data set's factors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..errors import InvalidInputError
from ._assembly import Factors, Product, Scattered, Summed
from ._engine import JacobianFactors
from ._factor_products import parameter_blocks
from ._rules_conv import has_closed_form_conv
from ._rules_conv1d import is_hf_conv1d

__all__ = ["KFAC_APPROXIMATIONS", "check_kfac_approx", "kronecker_factors"]

#: The two KFAC settings for layers shared over tokens.
KFAC_APPROXIMATIONS = ("expand", "reduce")

#: Largest rearranged block (elements) decomposed exactly; beyond it the power
#: method, with its iterations and tolerance (change of the unit-norm factor).
_DENSE_ELEMENTS = 2**25
_NKP_ITERATIONS = 1000
_NKP_TOLERANCE = 1e-12


def check_kfac_approx(approx: str) -> str:
    """Return ``approx`` if it is ``'expand'`` or ``'reduce'``.

    Returns
    -------
    str
        ``approx``.

    Raises
    ------
    InvalidInputError
        Naming the two settings.

    """
    if approx not in KFAC_APPROXIMATIONS:
        raise InvalidInputError(
            f"kfac_approx must be 'expand' or 'reduce' (Eschenhagen et al. 2023), "
            f"not {approx!r}."
        )
    return approx


def kronecker_factors(
    parts: JacobianFactors,
    params: Sequence[torch.Tensor],
    owners: Mapping[int, nn.Module],
    approx: str = "expand",
) -> list[list[torch.Tensor]]:
    """laplace-torch ``Kron`` factors of ``Σ_b Σ_v ρ_bv ρ_bvᵀ``, one block a parameter.

    Parameters
    ----------
    parts : JacobianFactors
        Factors of the rows ``s_bvᵀ J_b`` of ``B`` samples (square roots of the
        loss Hessian, see :mod:`._loss_seeds`).
    params : sequence of torch.Tensor
        The parameters, in laplace-torch's order.
    owners : mapping
        ``id(param) -> module`` that holds it (``nn.MultiheadAttention`` for its
        ``out_proj``).
    approx : {'expand', 'reduce'}
        KFAC setting for layers shared over tokens.

    Returns
    -------
    list of list of torch.Tensor
        Per parameter ``[F]`` or ``[F0, F1]`` in the dtype of ``parts``.

    """
    check_kfac_approx(approx)
    return [_parameter_factors(parts, p, owners[id(p)], approx) for p in params]


def _parameter_factors(
    parts: JacobianFactors, p: torch.Tensor, owner: nn.Module, approx: str
) -> list[torch.Tensor]:
    entries = parts.factors.get(id(p), [])
    if not entries:
        return [
            torch.zeros(n, n, dtype=parts.f.dtype, device=parts.f.device)
            for n in _factor_sizes(p)
        ]
    if has_closed_form_conv(owner) and _all(entries, (Product, Summed)):
        return _conv_factors(entries, parts.batch)
    if _shared_linear(owner) and _all(entries, (Product, Summed, Scattered)):
        return _kfac_factors(entries, owner, parts.batch, approx)
    if p.dim() == 1 or _factor_sizes(p)[0] == 1:
        return _exact_factors(parts, p)
    return _nearest_kronecker(parts, p)


def _factor_sizes(p: torch.Tensor) -> tuple[int, ...]:
    """laplace-torch's factor sizes: ``(n,)`` or ``(m, n)``."""
    if p.dim() == 1:
        return (p.shape[0],)
    return (p.shape[0], p[0].numel())


def _all(entries: Sequence[Factors], kinds: tuple[type, ...]) -> bool:
    return all(isinstance(e, kinds) for e in entries)


def _shared_linear(owner: nn.Module) -> bool:
    """Modules whose parameters enter linearly, shared over tokens."""
    kinds = (nn.Linear, nn.Embedding, nn.MultiheadAttention, nn.RNNBase)
    return isinstance(owner, kinds) or is_hf_conv1d(owner)


def _signal_gram(entries: Sequence[Factors], reduce: bool) -> torch.Tensor:
    """``Σ g gᵀ`` over samples, rows (and tokens unless ``reduce``) of all entries."""
    if reduce:  # signals summed over tokens and calls, then squared
        total = sum(_signals(e).sum(3) for e in entries)  # (B, V, out)
        flat = total.reshape(-1, total.shape[-1])  # type: ignore[union-attr]
        return flat.T @ flat
    grams = []
    for e in entries:
        g = _signals(e)  # (B, V, out, L)
        flat = g.transpose(2, 3).reshape(-1, g.shape[2])
        grams.append(flat.T @ flat)
    return torch.stack(grams).sum(0)


def _signals(e: Factors) -> torch.Tensor:
    """The entry's signals as ``(B, V, out, L)``."""
    if isinstance(e, Product):
        return e.g
    if isinstance(e, Summed):
        return e.g.transpose(0, 1)
    assert isinstance(e, Scattered)
    return e.g.permute(1, 0, 3, 2)  # (V, B, L, K) -> (B, V, K, L)


def _tokens(entries: Sequence[Factors]) -> int:
    return sum(_signals(e).shape[3] for e in entries)


def _conv_factors(entries: Sequence[Factors], batch: int) -> list[torch.Tensor]:
    """BackPACK's ``KFLR`` of a convolution: ``[G, A]`` or ``[G]`` (the bias)."""
    G = _signal_gram(entries, reduce=True)
    inputs = [e.a for e in entries if isinstance(e, Product)]
    if not inputs:
        return [G]
    flat = torch.cat([a.reshape(-1, a.shape[2]) for a in inputs])
    return [G, flat.T @ flat / batch]


def _kfac_factors(
    entries: Sequence[Factors], owner: nn.Module, batch: int, approx: str
) -> list[torch.Tensor]:
    """KFAC expand/reduce of a weight shared over tokens, or of its bias."""
    reduce = approx == "reduce"
    G = _signal_gram(entries, reduce)
    tokens = _tokens(entries)
    first = entries[0]
    if isinstance(first, Summed):  # a bias: a weight of input 1
        return [G]
    if isinstance(first, Scattered):
        A = _embedding_inputs(entries, owner, reduce)  # (vocab, vocab), summed
        return [A, G / (batch * (1 if reduce else tokens))]
    assert isinstance(first, Product)
    A = _input_gram(entries, reduce)
    if first.transposed:  # weight (in, out): input factor first
        return [A / (1 if reduce else tokens), G / batch]
    return [G, A / (batch * (1 if reduce else tokens))]


def _input_gram(entries: Sequence[Factors], reduce: bool) -> torch.Tensor:
    """``Σ a aᵀ`` over samples and tokens, or ``Σ ā āᵀ`` of token means (reduce)."""
    inputs = [e.a for e in entries if isinstance(e, Product)]  # (B, L, K) each
    if reduce:
        mean = torch.cat(inputs, dim=1).mean(1)  # (B, K)
        return mean.T @ mean
    flat = torch.cat([a.reshape(-1, a.shape[2]) for a in inputs])
    return flat.T @ flat


def _embedding_inputs(
    entries: Sequence[Factors], owner: nn.Module, reduce: bool
) -> torch.Tensor:
    """The one-hot inputs' factor ``(vocab, vocab)``; padding rows are not inputs."""
    scattered = [e for e in entries if isinstance(e, Scattered)]
    index = torch.cat([e.index for e in scattered], dim=1)
    weight = owner.weight
    assert isinstance(weight, torch.Tensor)
    onehot = nn.functional.one_hot(index, weight.shape[0]).to(scattered[0].g.dtype)
    padding = getattr(owner, "padding_idx", None)
    if padding is not None:
        onehot[..., padding] = 0
    if reduce:
        mean = onehot.mean(1)
        return mean.T @ mean
    return torch.diag(onehot.sum((0, 1)))


def _exact_block(parts: JacobianFactors, p: torch.Tensor) -> torch.Tensor:
    """``Σ_b Σ_v ρ_bv ρ_bvᵀ`` ``(n, n)``, a few samples at a time."""
    total = torch.zeros(p.numel(), p.numel(), dtype=parts.f.dtype, device=p.device)
    for _, J in parameter_blocks(parts, p):
        rows = J.reshape(-1, J.shape[2])
        total = total + rows.T @ rows
    return total


def _exact_factors(parts: JacobianFactors, p: torch.Tensor) -> list[torch.Tensor]:
    """The exact block: ``[H]``, or ``[[B], H / B]`` where ``F0`` is ``1×1``."""
    block = _exact_block(parts, p)
    if p.dim() == 1:
        return [block]
    count = torch.full((1, 1), float(parts.batch), dtype=block.dtype, device=p.device)
    return [count, block / parts.batch]


def _nearest_kronecker(parts: JacobianFactors, p: torch.Tensor) -> list[torch.Tensor]:
    """``σ Ĝ ⊗ Â`` nearest to the exact block (Van Loan and Pitsianis, 1993).

    With ``ρ_i`` the Jacobian rows as ``(m, n)`` matrices, the rearranged block is
    ``R[(a, c), (b, d)] = Σ_i ρ_i[a, b] ρ_i[c, d]``; its top singular pair gives
    positive semi-definite factors. ``R`` is formed where it is no larger than
    ``_DENSE_ELEMENTS`` (the size of the exact block) and decomposed exactly;
    otherwise the power method runs on ``R vec(A) = Σ_i ρ_i A ρ_iᵀ`` and
    ``Rᵀ vec(G) = Σ_i ρ_iᵀ G ρ_i`` until the factors settle. Both run in float64
    on the rows scaled to a largest entry of one, whatever the model's dtype.
    ``F0 = σ Ĝ`` sums over the batch, ``F1 = Â`` (unit Frobenius norm) does not
    grow with it.

    Returns
    -------
    list of torch.Tensor
        ``[σ Ĝ (m, m), Â (n, n)]``, ``Â`` of positive trace.

    """
    m, n = _factor_sizes(p)
    rows = torch.cat([J.reshape(-1, m, n) for _, J in parameter_blocks(parts, p)])
    # float64 and unit scale: float32 neither reaches the tolerance nor keeps the
    # norms of tiny Jacobians (~1e-13) from underflowing
    scale = rows.abs().max()
    if scale == 0:
        return [torch.zeros(k, k, dtype=rows.dtype, device=rows.device) for k in (m, n)]
    unit = rows.double() / scale.double()
    if (m * n) ** 2 <= _DENSE_ELEMENTS:
        R = torch.einsum("iab,icd->acbd", unit, unit).reshape(m * m, n * n)
        U, S, Vh = torch.linalg.svd(R, full_matrices=False)
        G, A, sigma = U[:, 0].reshape(m, m), Vh[0].reshape(n, n), S[0]
    else:
        G, A, sigma = _power_method(unit)
    if torch.trace(A) < 0:
        G, A = -G, -A
    sigma = sigma * scale.double() ** 2
    return [(sigma * G).to(rows.dtype), A.to(rows.dtype)]


def _power_method(
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top singular pair of the rearranged block of ``rows`` ``(N, m, n)``.

    Returns
    -------
    G, A : torch.Tensor
        Unit Frobenius norm, ``(m, m)`` and ``(n, n)``.
    sigma : torch.Tensor
        The singular value.

    """
    n = rows.shape[2]
    A = torch.eye(n, dtype=rows.dtype, device=rows.device) / n**0.5
    G = sigma = rows.new_zeros(())
    for _ in range(_NKP_ITERATIONS):
        G = torch.einsum("imk,kl,inl->mn", rows, A, rows)
        G = G / G.norm()
        A_new = torch.einsum("ikm,kl,iln->mn", rows, G, rows)
        sigma = A_new.norm()
        A_new = A_new / sigma
        settled = (A_new - A).norm() <= _NKP_TOLERANCE
        A = A_new
        if settled:
            break
    return G, A, sigma
