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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InvalidInputError
from ._assembly import Factors, Product, Scattered, Summed
from ._engine import JacobianFactors
from ._factor_products import parameter_blocks
from ._rules_conv import has_closed_form_conv
from ._rules_conv1d import is_hf_conv1d

__all__ = [
    "KFAC_APPROXIMATIONS",
    "KroneckerSums",
    "check_kfac_approx",
    "kronecker_factors",
]

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
    sums = KroneckerSums(params, owners, approx)
    sums.add(parts)
    return sums.factors()


class KroneckerSums:
    """The factors of :func:`kronecker_factors`, summed over chunks of the rows.

    Every factor that depends on the rows is a sum over them (the signal Grams
    ``G``, the exact blocks), and every other one depends on the inputs alone (the
    input factors ``A``, taken from the first chunk), so that chunks of rows of
    the same samples (:func:`._engine.row_chunked_factors`) give the factors of
    all the rows; only the nearest Kronecker product keeps its parameter's
    Jacobian rows until :meth:`factors`.

    Parameters
    ----------
    params, owners, approx
        As for :func:`kronecker_factors`.

    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        owners: Mapping[int, nn.Module],
        approx: str = "expand",
    ) -> None:
        self._approx = check_kfac_approx(approx)
        self._params = list(params)
        self._owners = owners
        self._sums: dict[int, _Sums] = {}

    def add(self, parts: JacobianFactors) -> None:
        """Add one chunk of rows (of the same samples as every other chunk)."""
        for p in self._params:
            sums = self._sums.get(id(p))
            if sums is None:
                route = _route(parts, p, self._owners[id(p)])
                sums = self._sums[id(p)] = _Sums(route, parts.batch, parts.f)
            _add(sums, parts, p, self._owners[id(p)], self._approx)

    def factors(self) -> list[list[torch.Tensor]]:
        """Per parameter ``[F]`` or ``[F0, F1]`` of the rows added so far.

        Returns
        -------
        list of list of torch.Tensor

        """
        return [_finish(self._sums[id(p)], p, self._approx) for p in self._params]


@dataclass
class _Sums:
    """One parameter's running sums: its route, and what it has summed or kept."""

    route: str  # "zero", "conv", "kfac", "exact" or "nearest"
    batch: int
    like: torch.Tensor  # the model output: dtype and device
    total: torch.Tensor | None = None  # G, or the exact block
    inputs: Any = None  # the input factors, from the first chunk
    rows: list[torch.Tensor] = field(default_factory=list)  # nearest: ρ (N, m, n)


def _route(parts: JacobianFactors, p: torch.Tensor, owner: nn.Module) -> str:
    """Which approximation the module docstring gives ``p``."""
    entries = parts.factors.get(id(p), [])
    if not entries:
        return "zero"
    if has_closed_form_conv(owner) and _all(entries, (Product, Summed)):
        return "conv"
    if _shared_linear(owner) and _all(entries, (Product, Summed, Scattered)):
        return "kfac"
    if p.dim() == 1 or _factor_sizes(p)[0] == 1:
        return "exact"
    return "nearest"


def _add(
    sums: _Sums, parts: JacobianFactors, p: torch.Tensor, owner: nn.Module, approx: str
) -> None:
    """Add one chunk's part of ``p``'s factors to ``sums``."""
    entries = parts.factors.get(id(p), [])
    if sums.route == "zero":
        return
    if sums.route == "nearest":
        m, n = _factor_sizes(p)
        sums.rows.extend(J.reshape(-1, m, n) for _, J in parameter_blocks(parts, p))
        return
    if sums.route == "exact":
        part = _exact_block(parts, p)
    else:
        part = _signal_gram(entries, reduce=sums.route == "conv" or approx == "reduce")
        if sums.inputs is None and sums.route == "conv":
            sums.inputs = _conv_inputs(entries, parts.batch)
        elif sums.inputs is None:
            sums.inputs = _kfac_inputs(entries, owner, approx == "reduce")
    sums.total = part if sums.total is None else sums.total + part


def _finish(sums: _Sums, p: torch.Tensor, approx: str) -> list[torch.Tensor]:
    """``p``'s factors from its sums."""
    if sums.route == "zero":
        like = sums.like
        return [
            torch.zeros(n, n, dtype=like.dtype, device=like.device)
            for n in _factor_sizes(p)
        ]
    if sums.route == "nearest":
        return _nearest_kronecker(torch.cat(sums.rows), *_factor_sizes(p))
    assert sums.total is not None
    if sums.route == "exact":
        return _exact_factors(sums.total, p, sums.batch)
    if sums.route == "conv":
        return [sums.total, *sums.inputs]
    return _kfac_factors(sums.total, sums.inputs, sums.batch, approx)


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


def _conv_inputs(entries: Sequence[Factors], batch: int) -> list[torch.Tensor]:
    """BackPACK's ``KFLR`` input factor of a convolution.

    With the signal Gram ``G`` of :func:`_signal_gram` (``reduce``), the factors
    are ``[G, A]``, or ``[G]`` for a bias.

    Returns
    -------
    list of torch.Tensor
        ``[A]``, or ``[]`` for a bias.

    """
    inputs = [e.a for e in entries if isinstance(e, Product)]
    if not inputs:
        return []
    flat = torch.cat([a.reshape(-1, a.shape[2]) for a in inputs])
    return [flat.T @ flat / batch]


@dataclass(frozen=True)
class _KfacInputs:
    """What KFAC takes from a layer's inputs (and none of its signals).

    Attributes
    ----------
    kind : str
        ``'bias'``, ``'embedding'``, ``'transposed'`` (a weight ``(in, out)``) or
        ``'weight'``.
    A : torch.Tensor or None
        The input factor before its normalisation; ``None`` for a bias.
    tokens : int
        Tokens summed over, all calls together.

    """

    kind: str
    A: torch.Tensor | None
    tokens: int


def _kfac_inputs(
    entries: Sequence[Factors], owner: nn.Module, reduce: bool
) -> _KfacInputs:
    """The input side of KFAC expand/reduce of a weight shared over tokens."""
    tokens = _tokens(entries)
    first = entries[0]
    if isinstance(first, Summed):  # a bias: a weight of input 1
        return _KfacInputs("bias", None, tokens)
    if isinstance(first, Scattered):
        A = _embedding_inputs(entries, owner, reduce)  # (vocab, vocab), summed
        return _KfacInputs("embedding", A, tokens)
    assert isinstance(first, Product)
    kind = "transposed" if first.transposed else "weight"
    return _KfacInputs(kind, _input_gram(entries, reduce), tokens)


def _kfac_factors(
    G: torch.Tensor, inputs: _KfacInputs, batch: int, approx: str
) -> list[torch.Tensor]:
    """KFAC expand/reduce of a weight shared over tokens, or of its bias."""
    per_token = 1 if approx == "reduce" else inputs.tokens
    if inputs.A is None:
        return [G]
    if inputs.kind == "embedding":
        return [inputs.A, G / (batch * per_token)]
    if inputs.kind == "transposed":  # weight (in, out): input factor first
        return [inputs.A / per_token, G / batch]
    return [G, inputs.A / (batch * per_token)]


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


def _exact_factors(
    block: torch.Tensor, p: torch.Tensor, batch: int
) -> list[torch.Tensor]:
    """The exact block: ``[H]``, or ``[[B], H / B]`` where ``F0`` is ``1×1``."""
    if p.dim() == 1:
        return [block]
    count = torch.full((1, 1), float(batch), dtype=block.dtype, device=p.device)
    return [count, block / batch]


def _nearest_kronecker(rows: torch.Tensor, m: int, n: int) -> list[torch.Tensor]:
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

    Parameters
    ----------
    rows : torch.Tensor
        ``(N, m, n)``: the parameter's Jacobian rows, in any order.
    m, n : int
        laplace-torch's factor sizes.

    Returns
    -------
    list of torch.Tensor
        ``[σ Ĝ (m, m), Â (n, n)]``, ``Â`` of positive trace.

    """
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
