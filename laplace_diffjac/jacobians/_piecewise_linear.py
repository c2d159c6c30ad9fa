"""Piecewise-linear activations and max pooling as selections: signals free of x.

``relu(x)`` is ``x`` where ``x > 0`` and ``0`` elsewhere. PyTorch's kernel saves
``x`` (or its output) for its backward, so the signal sent back through it,
``g · 1[x > 0]``, is a function of ``x`` in the graph that
``create_graph=True`` builds, although its derivative in ``x`` is zero almost
everywhere. Every derivative of a function of the Jacobians then sends zeros
back through the signals: for a ReLU network, the backward pass of a Gram's
gradient in the inputs computes each layer's signal gradient (two products of
the signal Gram's size per layer) only to multiply it by zero.

Max pooling is the same kind of selection (its backward scatters to the
maxima's indices, found from the input). Here the activations are written as
``torch.where`` on a mask, and max pooling as a ``gather`` at indices found
without a graph: the same values, the same derivatives (0 at the kinks, as
PyTorch's kernels have it), and backward passes that hold the mask or the
indices but not ``x``, so that the signals of a network of Linear or
convolution layers, these modules and affine normalisations are constants of
the inputs and the gradient in the inputs flows through the layer inputs
alone. Derivatives in the parameters are unchanged: they reach the signals
through the weights.
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


def recorded_max_pool(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, object]:
    """``nn.MaxPool1d/2d/3d``: the input gathered at the maxima's indices.

    The indices are found without a graph; ``gather`` sends the gradient back to
    them as PyTorch's kernel does (the same index on ties), with a backward that
    does not hold the input.

    Parameters
    ----------
    module : torch.nn.MaxPool1d, MaxPool2d or MaxPool3d
        The module.
    args, kwargs
        The arguments of its call: the input, ``(N, C, *spatial)`` or
        ``(C, *spatial)``.

    Returns
    -------
    call : LayerCall
        The call.
    output : torch.Tensor or tuple
        Equal to the module's output (with ``return_indices``, the module's own
        pair, not rewritten).

    """
    m: nn.MaxPool2d = module  # type: ignore[assignment]
    (x,) = args
    dims = _POOL_DIMS[type(module)]
    pool = _POOLS[dims]
    settings = (m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)
    if m.return_indices:
        pair = pool(x, *settings, return_indices=True)
        return LayerCall(module, tuple(args), pair[0], kwargs, (pair[0],)), pair
    with torch.no_grad():
        _, index = pool(x, *settings, return_indices=True)
    out = x.flatten(-dims).gather(-1, index.flatten(-dims)).view(index.shape)
    return LayerCall(module, tuple(args), out, kwargs, (out,)), out


_POOL_DIMS: dict[type[nn.Module], int] = {
    nn.MaxPool1d: 1,
    nn.MaxPool2d: 2,
    nn.MaxPool3d: 3,
}
_POOLS = {
    1: torch.nn.functional.max_pool1d,
    2: torch.nn.functional.max_pool2d,
    3: torch.nn.functional.max_pool3d,
}


#: Module type -> its computation as a selection (exact types: subclasses with a
#: forward of their own keep it).
PIECEWISE_LINEAR_FORWARDS: dict[type[nn.Module], RecordedForward] = {
    nn.ReLU: recorded_relu,
    nn.LeakyReLU: recorded_leaky_relu,
    nn.Hardtanh: recorded_hardtanh,
    nn.ReLU6: recorded_hardtanh,
    nn.MaxPool1d: recorded_max_pool,
    nn.MaxPool2d: recorded_max_pool,
    nn.MaxPool3d: recorded_max_pool,
}
