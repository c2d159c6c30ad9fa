"""``nn.PReLU`` in elementary operations, and its per-sample Jacobian factors.

``PReLU(x) = max(x, 0) + w · min(x, 0)`` with one slope ``w`` shared by all
channels or one per channel (dimension 1), so with signals ``g`` at the output the
per-sample weight block is ``Σ g · min(x, 0)`` over the positions of each slope.

PyTorch's batching rule for the backward of ``prelu`` is wrong under nested
``vmap`` (``vmap(jacrev)`` of a Linear-PReLU-Linear network crashes when the batch
size differs from the number of outputs and gives wrong Jacobians when they are
equal; pinned in ``tests/backends/test_upstream_pins.py``). Both backends therefore run
PReLU in the elementary form below while they differentiate: the same values, and
at ``x = 0`` the same derivative as PyTorch's kernel (``w``).
"""

from __future__ import annotations

import torch
from torch import nn

from ._assembly import Dense, Factors
from ._layer_calls import LayerCall


def recorded_prelu(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, torch.Tensor]:
    """``module(x)`` for an ``nn.PReLU``, as ``where(x > 0, x, 0) + w · x⁻``.

    Parameters
    ----------
    module : torch.nn.PReLU
        The module.
    args, kwargs
        The arguments of its call (the input ``(batch, C, *)`` or ``(batch,)``).

    Returns
    -------
    call : LayerCall
        The call, ``kwargs["negative"]`` the part ``x⁻ = where(x > 0, 0, x)``.
    output : torch.Tensor
        Equal to the module's output.

    """
    m: nn.PReLU = module  # type: ignore[assignment]
    (x,) = args
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    positive = torch.where(x > 0, x, zero)
    negative = torch.where(x > 0, zero, x)
    out = positive + _slopes(m.weight, x) * negative
    return LayerCall(m, (x,), out, {"negative": negative}, (out,)), out


def _slopes(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The slopes broadcast against ``x`` (per channel along dimension 1)."""
    if weight.numel() == 1:
        return weight.reshape(())
    if x.dim() == 1:
        return weight
    return weight.reshape((1, -1) + (1,) * (x.dim() - 2))


def prelu_factors(
    call: LayerCall, grads: tuple[torch.Tensor | None, ...], wanted: set[int]
) -> list[tuple[int, Factors]]:
    """The weight block ``Σ g · x⁻`` for signals ``(V, batch, *output_shape)``.

    Parameters
    ----------
    call : LayerCall
        A call recorded by :func:`recorded_prelu`.
    grads : tuple
        ``(g,)`` with ``g`` ``(V, batch, *output_shape)``, or ``(None,)``.
    wanted : set of int
        ``id`` of the parameters of interest.

    Returns
    -------
    list of (int, Factors)
        One ``Dense`` block ``(V, batch, n_slopes)``, if wanted and reached.

    """
    module: nn.PReLU = call.module  # type: ignore[assignment]
    g = grads[0]
    if g is None or id(module.weight) not in wanted:
        return []
    n_rows, batch = g.shape[:2]
    n_slopes = module.weight.numel()
    negative = call.kwargs["negative"]
    if n_slopes == 1:
        block = (g * negative).reshape(n_rows, batch, -1).sum(-1, keepdim=True)
    else:
        per_channel = (g * negative).reshape(n_rows, batch, n_slopes, -1)
        block = per_channel.sum(-1)
    return [(id(module.weight), Dense(block))]
