"""Piecewise-linear activations as selections, so that signals do not depend on x.

``relu(x)`` is ``x`` where ``x > 0`` and ``0`` elsewhere. PyTorch's kernel saves
``x`` (or its output) for its backward, so the signal sent back through it,
``g · 1[x > 0]``, is a function of ``x`` in the graph that
``create_graph=True`` builds, although its derivative in ``x`` is zero almost
everywhere. Every derivative of a function of the Jacobians then sends zeros
back through the signals: for a ReLU network, the backward pass of a Gram's
gradient in the inputs computes each layer's signal gradient (two products of
the signal Gram's size per layer) only to multiply it by zero.

Here the same activations are written as ``torch.where`` on a mask: the same
values, the same derivative (0 at the kinks, as PyTorch's kernels have it), and
a backward whose graph holds the mask but not ``x``, so that the signals of a
network of Linear or convolution layers, these activations and affine
normalisations are constants of the inputs and the gradient in the inputs flows
through the layer inputs alone. Derivatives in the parameters are unchanged:
they reach the signals through the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from ._layer_calls import LayerCall, RecordedForward

__all__ = ["PIECEWISE_LINEAR_FORWARDS"]


def recorded_relu(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, torch.Tensor]:
    """``nn.ReLU``: ``where(x > 0, x, 0)``.

    Parameters
    ----------
    module : torch.nn.ReLU
        The module (``inplace`` or not: the caller passes the input as it was).
    args, kwargs
        The arguments of its call (the input, any shape).

    Returns
    -------
    call : LayerCall
        The call.
    output : torch.Tensor
        Equal to the module's output.

    """
    (x,) = args
    out = torch.where(x > 0, x, 0.0)
    return LayerCall(module, tuple(args), out, kwargs, (out,)), out


def recorded_leaky_relu(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, torch.Tensor]:
    """``nn.LeakyReLU``: ``where(x > 0, x, slope · x)``.

    Parameters
    ----------
    module : torch.nn.LeakyReLU
        The module.
    args, kwargs
        The arguments of its call (the input, any shape).

    Returns
    -------
    call : LayerCall
        The call.
    output : torch.Tensor
        Equal to the module's output.

    """
    m: nn.LeakyReLU = module  # type: ignore[assignment]
    (x,) = args
    out = torch.where(x > 0, x, x * m.negative_slope)
    return LayerCall(module, tuple(args), out, kwargs, (out,)), out


def recorded_hardtanh(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, torch.Tensor]:
    """``nn.Hardtanh`` and ``nn.ReLU6``: ``x`` inside ``(min, max)``, the bound outside.

    Parameters
    ----------
    module : torch.nn.Hardtanh
        The module (``ReLU6`` is a ``Hardtanh`` on ``(0, 6)``).
    args, kwargs
        The arguments of its call (the input, any shape).

    Returns
    -------
    call : LayerCall
        The call.
    output : torch.Tensor
        Equal to the module's output.

    """
    m: nn.Hardtanh = module  # type: ignore[assignment]
    (x,) = args
    inside = (x > m.min_val) & (x < m.max_val)
    out = torch.where(inside, x, x.detach().clamp(m.min_val, m.max_val))
    return LayerCall(module, tuple(args), out, kwargs, (out,)), out


#: Module type -> its computation as a selection (exact types: subclasses with a
#: forward of their own keep it).
PIECEWISE_LINEAR_FORWARDS: dict[type[nn.Module], RecordedForward] = {
    nn.ReLU: recorded_relu,
    nn.LeakyReLU: recorded_leaky_relu,
    nn.Hardtanh: recorded_hardtanh,
    nn.ReLU6: recorded_hardtanh,
}
