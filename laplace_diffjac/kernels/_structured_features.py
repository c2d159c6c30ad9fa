"""Per-side pieces of the structured NTK, so each side is computed (and cached) once.

For a chain of ``Linear`` layers and elementwise activations the Jacobian of
output ``c`` with respect to layer ``l``'s weight is ``g_l[c] ⊗ a_{l-1}``, so

    J(x1) J(x2)ᵀ = Σ_l (a_{l-1}(x1)·a_{l-1}(x2) + 1[bias]) · g_l(x1) g_l(x2)ᵀ.

:class:`NTKFeatures` holds, for one batch, the layer inputs ``a_{l-1}`` and the
output signals ``g_l`` of every Linear layer with a parameter in the Jacobian.
They depend on one side only: a caller that pairs many location batches with the
same training inputs computes the training side once (:func:`ntk_features`)
and reuses it; :func:`feature_gram` and :func:`feature_diag` contract two sides
or one side with itself. Everything is ordinary autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ._activations import ACTIVATIONS

__all__ = ["NTKFeatures", "feature_diag", "feature_gram", "ntk_features"]


@dataclass(frozen=True)
class NTKFeatures:
    """Layer inputs and output signals of one batch of ``B`` inputs.

    Attributes
    ----------
    inputs : tuple of torch.Tensor
        Per contributing Linear layer, its input ``(B, width_in)``.
    signals : tuple of (torch.Tensor or None)
        Per contributing Linear layer, ``∂f/∂(layer output)`` ``(B, C, width_out)``,
        or ``None`` for the last layer (the identity).
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

    @staticmethod
    def cat(parts: Sequence[NTKFeatures]) -> NTKFeatures:
        """Concatenate the features of consecutive batches of the same model."""
        first = parts[0]
        inputs = tuple(
            torch.cat([p.inputs[i] for p in parts]) for i in range(len(first.inputs))
        )
        signals = tuple(
            None if g is None else torch.cat([_signal(p, i) for p in parts])
            for i, g in enumerate(first.signals)
        )
        return NTKFeatures(inputs, signals, first.weight, first.bias, first.n_outputs)


def _signal(f: NTKFeatures, i: int) -> torch.Tensor:
    g = f.signals[i]
    assert g is not None
    return g


def ntk_features(
    layers: Sequence[nn.Module], x: torch.Tensor, wanted: set[int]
) -> NTKFeatures:
    """Forward pass recording what the structured Gram needs of one side.

    Parameters
    ----------
    layers : sequence of torch.nn.Module
        The model's leaves in call order (Linear, elementwise activations from
        :data:`laplace_diffjac.kernels.ACTIVATIONS`, Identity, Flatten, eval
        Dropout); checked by the caller.
    x : torch.Tensor
        ``(B, *input_shape)``.
    wanted : set of int
        ``id`` of the parameters in the Jacobian (at least one).

    Returns
    -------
    NTKFeatures
        Differentiable with respect to ``x`` and the parameters.

    Raises
    ------
    ValueError
        If a ``Linear`` layer receives a non-2-D input, the output is not 2-D, or
        no parameter is wanted.

    """
    trace = _forward_trace(layers, x)
    out = trace[-1]
    inputs: list[torch.Tensor] = []
    signals: list[torch.Tensor | None] = []
    weight: list[bool] = []
    bias: list[bool] = []
    for linear, a, g in _output_signals(trace):
        has_w = id(linear.weight) in wanted
        has_b = linear.bias is not None and id(linear.bias) in wanted
        if has_w or has_b:
            inputs.append(a)
            signals.append(g)
            weight.append(has_w)
            bias.append(has_b)
    if not inputs:
        raise ValueError("No parameter of the model is in the Jacobian.")
    return NTKFeatures(
        tuple(inputs), tuple(signals), tuple(weight), tuple(bias), out.shape[1]
    )


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
        scale = scale[:, None, :, None]
        kernel = scale * gram if kernel is None else torch.addcmul(kernel, scale, gram)
    if kernel is None:
        assert identity is not None
        kernel = identity.new_zeros((n1, c, n2, c))
    if identity is not None:  # add to the (c, c) diagonals only
        kernel.diagonal(dim1=1, dim2=3).add_(identity[:, :, None])
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


def _forward_trace(layers: Sequence[nn.Module], x: torch.Tensor) -> list:
    """Run the chain and record what the output signals need.

    Returns ``[op, ..., output]`` with ``op`` either ``('linear', module, input)``
    or ``('scale', derivative (B, width))``.

    Returns
    -------
    list
        The recorded operations followed by the output.

    Raises
    ------
    ValueError
        If a Linear layer gets an input that is not ``(batch, features)``.

    """
    ops: list = []
    h = x
    for m in layers:
        if type(m) is nn.Linear:
            if h.dim() != 2:
                raise ValueError(
                    "structured_ntk needs (batch, features) inputs to every Linear "
                    f"layer; got {tuple(h.shape)}. Add nn.Flatten() or use "
                    "laplace_diffjac.kernels.ntk."
                )
            ops.append(("linear", m, h))
            h = F.linear(h, m.weight, m.bias)
        elif type(m) in ACTIVATIONS:
            z = h
            a = m(z.clone() if getattr(m, "inplace", False) else z)
            ops.append(("scale", ACTIVATIONS[type(m)](m, z, a)))
            h = a
        elif type(m) is nn.Flatten:
            h = h.flatten(start_dim=1)
        # Identity and eval-mode Dropout: nothing to do.
    if h.dim() != 2:
        raise ValueError(f"structured_ntk needs (batch, C) outputs, got {h.shape}.")
    ops.append(h)
    return ops


def _output_signals(
    trace: list,
) -> list[tuple[nn.Linear, torch.Tensor, torch.Tensor | None]]:
    """Backpropagate the identity on the output to every Linear layer's output.

    Returns ``(linear, input (B, in), g (B, C, out) or None for identity)`` per
    Linear layer, in forward order.

    Returns
    -------
    list of tuple
        One entry per Linear layer, in forward order.

    """
    g: torch.Tensor | None = None
    result = []
    remaining = sum(1 for op in trace[:-1] if op[0] == "linear")
    for op in reversed(trace[:-1]):
        if remaining == 0:
            break
        if op[0] == "scale":
            d = op[1]
            g = torch.diag_embed(d) if g is None else g * d[:, None, :]
        else:
            linear, a = op[1], op[2]
            result.append((linear, a, g))
            remaining -= 1
            if remaining == 0:
                break
            weight = linear.weight
            if g is None:
                g = weight.expand(a.shape[0], *weight.shape)
            else:
                g = g @ weight
    return result[::-1]
