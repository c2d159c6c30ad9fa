"""Per-side pieces of the NTK of Linear layers, each side computed (and cached) once.

Where every parameter of the Jacobian belongs to a ``Linear``-like layer applied
once to one feature vector per input (a weight's Jacobian for output ``c`` is the
outer product ``g_l[c] ⊗ a_{l-1}``, its bias's is ``g_l[c]``),

    J(x1) J(x2)ᵀ = Σ_l (a_{l-1}(x1)·a_{l-1}(x2) + 1[bias]) · g_l(x1) g_l(x2)ᵀ.

:class:`NTKFeatures` holds, for one batch, the layer inputs ``a_{l-1}`` and the
output signals ``g_l`` of every such layer, whatever the model's module
structure: one walker of the model, the engine's. Where every parameter is an
``nn.Linear``'s they come straight off its pass (:func:`linear_features` of
:func:`laplace_diffjac.jacobians._engine.jacobian_pieces`); otherwise its
per-layer factors are regrouped by layer (:func:`chain_features`), a weight and
its bias sharing one signal. They depend on one side only: a caller that
pairs many location batches with the same training inputs computes the
training side once and reuses it; :func:`feature_gram` and
:func:`feature_diag` contract two sides or one side with itself, and the
location optimiser's Functions (:mod:`._cross_gram`, :mod:`._symmetric_gram`)
do so with a cheaper backward pass than autograd's through the engine's
general factor Gram.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..jacobians._assembly import Product, Summed
from ..jacobians._engine import JacobianFactors
from ..jacobians._linear_layers import LinearSignals

__all__ = [
    "NTKFeatures",
    "aligned",
    "chain_features",
    "feature_diag",
    "feature_gram",
    "features_of",
    "linear_features",
]


@dataclass(frozen=True)
class NTKFeatures:
    """Layer inputs and output signals of one batch of ``B`` inputs.

    Attributes
    ----------
    inputs : tuple of torch.Tensor
        Per contributing Linear layer, its input ``(B, width_in)``.
    signals : tuple of (torch.Tensor or None)
        Per contributing Linear layer, ``∂f/∂(layer output)`` ``(B, C, width_out)``,
        or ``None`` where it is the identity (a last layer that is the output).
        Two batches of one model may differ here (constant signals that equal the
        identity in one batch only): :func:`aligned` makes them agree.
    weight, bias : tuple of bool
        Per contributing Linear layer, whether its weight / bias is in the Jacobian.
    n_outputs : int
        ``C``.

    """

    inputs: tuple[torch.Tensor, ...]
    signals: tuple[torch.Tensor | None, ...]
    weight: tuple[bool, ...]
    bias: tuple[bool, ...]
    n_outputs: int

    def __len__(self) -> int:
        """Number ``B`` of inputs."""
        return int(self.inputs[0].shape[0])

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> NTKFeatures:
        return NTKFeatures(
            tuple(fn(a) for a in self.inputs),
            tuple(None if g is None else fn(g) for g in self.signals),
            self.weight,
            self.bias,
            self.n_outputs,
        )

    def __getitem__(self, index: torch.Tensor | slice) -> NTKFeatures:
        """The features of a subset of the inputs (index or slice on the batch)."""
        return self._map(lambda t: t[index])

    def to(self, dtype: torch.dtype) -> NTKFeatures:
        """The features cast to ``dtype`` (differentiable)."""
        return self._map(lambda t: t.to(dtype))

    def detach(self) -> NTKFeatures:
        """The features without graph."""
        return self._map(torch.Tensor.detach)

    def float_tensors(self) -> list[torch.Tensor]:
        """The tensors, in the order :meth:`with_tensors` takes them."""
        return [*self.inputs, *(g for g in self.signals if g is not None)]

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> NTKFeatures:
        """The same features made of ``tensors`` (as :meth:`float_tensors` lists)."""
        supply = iter(tensors)
        inputs = tuple(next(supply) for _ in self.inputs)
        signals = tuple(None if g is None else next(supply) for g in self.signals)
        return NTKFeatures(inputs, signals, self.weight, self.bias, self.n_outputs)

    def signal(self, i: int) -> torch.Tensor:
        """Layer ``i``'s signals ``(B, C, width_out)``, the identity written out."""
        g = self.signals[i]
        if g is not None:
            return g
        like = self.inputs[i]
        c = self.n_outputs
        eye = torch.eye(c, dtype=like.dtype, device=like.device)
        return eye.expand(len(self), c, c)

    @staticmethod
    def cat(parts: Sequence[NTKFeatures]) -> NTKFeatures:
        """Concatenate the features of consecutive batches of the same model."""
        first = parts[0]
        inputs = tuple(
            torch.cat([p.inputs[i] for p in parts]) for i in range(len(first.inputs))
        )
        signals = tuple(
            None
            if all(p.signals[i] is None for p in parts)
            else torch.cat([p.signal(i) for p in parts])
            for i in range(len(first.signals))
        )
        return NTKFeatures(inputs, signals, first.weight, first.bias, first.n_outputs)


def aligned(f1: NTKFeatures, f2: NTKFeatures) -> tuple[NTKFeatures, NTKFeatures]:
    """The two batches' features with the identity written out where only one has it.

    Returns
    -------
    tuple of NTKFeatures
        ``f1`` and ``f2``, each layer's signals ``None`` in both or in neither.
    """
    mixed = [
        i for i, (g1, g2) in enumerate(zip(f1.signals, f2.signals))
        if (g1 is None) != (g2 is None)
    ]  # fmt: skip
    if not mixed:
        return f1, f2

    def written(f: NTKFeatures) -> NTKFeatures:
        signals = tuple(
            f.signal(i) if i in mixed else g for i, g in enumerate(f.signals)
        )
        return NTKFeatures(f.inputs, signals, f.weight, f.bias, f.n_outputs)

    return written(f1), written(f2)


def chain_features(
    factors: JacobianFactors, params: Sequence[torch.Tensor]
) -> NTKFeatures | None:
    """The engine's factors regrouped by layer, if every block is a Linear layer's.

    Parameters
    ----------
    factors : JacobianFactors
        One batch's factors straight from the engine (before any cast, index or
        concatenation: a weight and its bias are recognised as one layer by
        sharing the same signal view).
    params : sequence of torch.Tensor
        The Jacobian's parameters, in column order (the layers follow it).

    Returns
    -------
    NTKFeatures or None
        ``None`` unless every parameter with Jacobian columns has exactly one
        entry, a one-position ``Product`` (a weight applied to one feature
        vector per input) or ``Summed`` (a bias): parameters shared between
        calls, tokens, positions, convolutions, embeddings and dense blocks take
        the general factor Gram. Constant identity signals (a last layer that is
        the output) are marked ``None``, so their Gram is the identity, never a
        product. Differentiable as the factors are.

    """
    layers: list[_Layer] = []
    by_signal: dict[tuple, _Layer] = {}
    for p in params:
        entries = factors.factors.get(id(p), [])
        if not entries:
            continue
        if len(entries) != 1:
            return None
        entry = entries[0]
        if isinstance(entry, Product) and entry.g.shape[3] == 1:
            signal = entry.g.select(3, 0)  # (B, V, out)
        elif isinstance(entry, Summed) and entry.g.shape[3] == 1:
            signal = entry.g.select(3, 0).transpose(0, 1)
        else:
            return None
        is_weight = isinstance(entry, Product)
        key = _view_key(signal)
        layer = by_signal.get(key)
        if layer is None or (layer.weight if is_weight else layer.bias):
            layer = by_signal[key] = _Layer(signal)
            layers.append(layer)
        if is_weight:
            assert isinstance(entry, Product)
            layer.weight, layer.input = True, entry.a.select(1, 0)
        else:
            layer.bias = True
    if not layers:
        return None
    batch = factors.batch
    return NTKFeatures(
        tuple(
            layer.signal.new_zeros(batch, 0) if layer.input is None else layer.input
            for layer in layers
        ),
        tuple(None if _is_identity(layer.signal) else layer.signal for layer in layers),
        tuple(layer.weight for layer in layers),
        tuple(layer.bias for layer in layers),
        factors.n_rows,
    )


def linear_features(layers: LinearSignals) -> NTKFeatures:
    """The engine's Linear layers as features (:func:`chain_features` without factors).

    Parameters
    ----------
    layers : LinearSignals
        One batch's layer inputs and signals, straight from the engine.

    Returns
    -------
    NTKFeatures
        Equal to :func:`chain_features` of the same pass's factors: the same
        layers in the same order, constant identity signals marked ``None``.
        Differentiable as the layers are.

    """
    return NTKFeatures(
        layers.inputs,
        tuple(
            None if seeded or _is_identity(g) else g
            for g, seeded in zip(layers.signals, layers.identity)
        ),
        layers.weight,
        layers.bias,
        layers.n_rows,
    )


def features_of(
    pieces: LinearSignals | JacobianFactors, params: Sequence[torch.Tensor]
) -> NTKFeatures | None:
    """One batch's features from what the engine gave, if it regroups by layer.

    Parameters
    ----------
    pieces : LinearSignals or JacobianFactors
        The engine's Linear layers (:func:`linear_features`) or its factors
        (:func:`chain_features`).
    params : sequence of torch.Tensor
        The Jacobian's parameters, in column order.

    Returns
    -------
    NTKFeatures or None
        ``None`` where the factors do not regroup.
    """
    if isinstance(pieces, LinearSignals):
        return linear_features(pieces)
    return chain_features(pieces, params)


class _Layer:
    """One layer's pieces while :func:`chain_features` gathers them."""

    def __init__(self, signal: torch.Tensor) -> None:
        self.signal = signal  # (B, V, out)
        self.input: torch.Tensor | None = None  # (B, in), for a weight
        self.weight = False
        self.bias = False


def _view_key(t: torch.Tensor) -> tuple:
    """What makes two views the same numbers: memory, geometry, type."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _is_identity(signal: torch.Tensor) -> bool:
    """Whether constant signals ``(B, V, V)`` are the identity for every input.

    A layer whose output is the model's output gets the engine's seeds, the
    identity, which does not depend on the input; its signal Gram is then the
    identity and needs no product (one comparison of ``B V²`` numbers).

    Returns
    -------
    bool
    """
    if signal.requires_grad or signal.shape[1] != signal.shape[2]:
        return False
    eye = torch.eye(signal.shape[1], dtype=signal.dtype, device=signal.device)
    return bool((signal == eye).all())


def _input_scale(
    a1: torch.Tensor,
    a2: torch.Tensor,
    weight: bool,
    bias: bool,
    factor: float | torch.Tensor,
) -> torch.Tensor:
    """``factor (a1 a2ᵀ [+ 1])`` ``(B1, B2)`` for the weight [and bias] in ``J``."""
    if not weight:
        return a1.new_full((a1.shape[0], a2.shape[0]), 1.0) * factor
    scale = a1 @ a2.T
    return (scale + 1.0 if bias else scale) * factor


def feature_gram(
    f1: NTKFeatures, f2: NTKFeatures, factor: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """``factor · J(x1) J(x2)ᵀ`` as a matrix from the two sides' features.

    Parameters
    ----------
    f1, f2 : NTKFeatures
        Features of ``B1`` and ``B2`` inputs of the same model and parameters.
    factor : float or torch.Tensor, default=1.0
        Scalar factor (e.g. the prior variance), applied to the ``(B1, B2)``
        input Grams rather than to the result.

    Returns
    -------
    torch.Tensor
        ``(B1 C, B2 C)``, rows and columns input-major: entry
        ``[a C + c, b C + e] = factor · J_c(x1_a) J_e(x2_b)ᵀ``.

    """
    f1, f2 = aligned(f1, f2)
    n1, n2, c = len(f1), len(f2), f1.n_outputs
    kernel = None
    identity = None
    layers = zip(f1.inputs, f1.signals, f2.inputs, f2.signals, f1.weight, f1.bias)
    for a1, g1, a2, g2, weight, bias in layers:
        scale = _input_scale(a1, a2, weight, bias, factor)
        if g1 is None or g2 is None:  # the last layer: g = identity
            identity = scale if identity is None else identity + scale
            continue
        gram = (g1.reshape(n1 * c, -1) @ g2.reshape(n2 * c, -1).T).view(n1, c, n2, c)
        scale = scale.reshape(n1, 1, n2, 1)
        kernel = scale * gram if kernel is None else torch.addcmul(kernel, scale, gram)
    if kernel is None:
        assert identity is not None
        kernel = identity.new_zeros((n1, c, n2, c))
    if identity is not None:  # add to the (c, c) diagonals only
        kernel.diagonal(dim1=1, dim2=3).add_(identity.unsqueeze(2))
    return kernel.reshape(n1 * c, n2 * c)


def feature_diag(f: NTKFeatures, factor: float | torch.Tensor = 1.0) -> torch.Tensor:
    """The per-input blocks ``factor · J(xₙ) J(xₙ)ᵀ`` from one side's features.

    Parameters
    ----------
    f : NTKFeatures
        Features of ``B`` inputs.
    factor : float or torch.Tensor, default=1.0
        Scalar factor (e.g. the prior variance).

    Returns
    -------
    torch.Tensor
        ``(B, C, C)``.

    """
    c = f.n_outputs
    blocks = None
    for a, g, weight, bias in zip(f.inputs, f.signals, f.weight, f.bias):
        scale = (a * a).sum(-1) if weight else a.new_zeros(a.shape[0])
        scale = (scale + 1.0 if bias else scale) * factor
        if g is None:
            eye = torch.eye(c, dtype=scale.dtype, device=scale.device)
            block = scale[:, None, None] * eye
        else:
            block = scale[:, None, None] * (g @ g.transpose(1, 2))
        blocks = block if blocks is None else blocks + block
    assert blocks is not None
    return blocks
