"""Step 3 where every parameter sits in a Linear layer: its input and its signals.

Where each parameter of the Jacobian belongs to an ``nn.Linear`` called once on
one feature vector per input (an MLP, whatever its module structure), row ``v``
of a weight's per-sample Jacobian is the outer product ``g[v] ⊗ a`` and a
bias's is ``g[v]``: the layer's input ``a`` ``(B, in)`` and the signals ``g``
``(B, V, out)`` at its output are all that the NTK's layer-wise Gram needs
(:mod:`laplace_diffjac.kernels._structured_features`). Read straight off the
recorded calls and the signal pass, they skip the factor objects that
:func:`.derivatives.param_jacobian_factors` builds for every kind of module and
that the kernels would take apart again; at Bayesian-optimisation sizes that
is about 50 µs of a 390 µs call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ._layer_calls import LayerCall

__all__ = ["LinearSignals", "linear_signals"]


@dataclass(frozen=True)
class LinearSignals:
    """The Linear layers of one batch of ``B`` inputs, in the parameters' order.

    Attributes
    ----------
    inputs : tuple of torch.Tensor
        Per layer, its input ``(B, in)``; ``(B, 0)`` where its weight is not in
        the Jacobian.
    signals : tuple of torch.Tensor
        Per layer, the signals at its output ``(B, V, out)``.
    weight, bias : tuple of bool
        Per layer, whether its weight / bias is in the Jacobian.
    identity : tuple of bool
        Per layer, whether its output is the model's ``(B, C)`` output, so that
        its signals are the seeds, the identity, by construction (no need to
        compare them, which would wait for the device).
    f : torch.Tensor
        Model output as returned by the model, ``(B, C)`` or ``(B,)``.
    n_rows : int
        Rows ``V`` per sample.
    batch : int
        ``B``.

    """

    inputs: tuple[torch.Tensor, ...]
    signals: tuple[torch.Tensor, ...]
    weight: tuple[bool, ...]
    bias: tuple[bool, ...]
    identity: tuple[bool, ...]
    f: torch.Tensor
    n_rows: int
    batch: int

    def detach(self) -> LinearSignals:
        """The same layers cut from the graph."""
        return LinearSignals(
            tuple(a.detach() for a in self.inputs),
            tuple(g.detach() for g in self.signals),
            self.weight,
            self.bias,
            self.identity,
            self.f.detach(),
            self.n_rows,
            self.batch,
        )


def linear_signals(
    calls: Sequence[LayerCall],
    grads: Sequence[tuple[torch.Tensor | None, ...]],
    params: Sequence[torch.Tensor],
    f: torch.Tensor,
    n_rows: int,
    batch: int,
) -> LinearSignals | None:
    """The layers' inputs and signals, if every recorded call is a plain Linear's.

    Parameters
    ----------
    calls : sequence of LayerCall
        The recorded calls of the modules that own ``params``.
    grads : sequence of tuple
        Per call, the signals at its outputs ``(V, B, out)`` (``None`` where the
        output does not reach the model's).
    params : sequence of torch.Tensor
        The Jacobian's parameters, in column order.
    f : torch.Tensor
        The model output.
    n_rows, batch : int
        ``V`` and ``B``.

    Returns
    -------
    LinearSignals or None
        ``None`` unless every call is of an ``nn.Linear`` (not a subclass) on a
        ``(B, in)`` input and no parameter is used by two calls: other modules,
        shared weights and Linear layers over tokens take the factors.
        A layer whose output does not reach the model's has no columns and is
        left out, as its factors would be.

    """
    position = {id(p): i for i, p in enumerate(params)}
    used: set[int] = set()
    layers: list[tuple[int, torch.Tensor, torch.Tensor, bool, bool, bool]] = []
    for call, signals in zip(calls, grads):
        module = call.module
        if type(module) is not nn.Linear:
            return None
        own = [id(module.weight)]
        if module.bias is not None:
            own.append(id(module.bias))
        own = [key for key in own if key in position]
        if used.intersection(own):
            return None
        used.update(own)
        g, a = signals[0], call.inputs[0]
        if a.dim() != 2:
            return None
        if g is None:
            continue
        weight = id(module.weight) in position
        bias = module.bias is not None and id(module.bias) in position
        first = min(position[key] for key in own)
        seeded = call.output is f and f.dim() == 2  # its signals are the seeds
        inputs = a if weight else a.new_zeros(batch, 0)
        layers.append((first, inputs, g, weight, bias, seeded))
    if not layers:
        return None
    layers.sort(key=lambda layer: layer[0])
    return LinearSignals(
        tuple(layer[1] for layer in layers),
        tuple(layer[2].transpose(0, 1) for layer in layers),
        tuple(layer[3] for layer in layers),
        tuple(layer[4] for layer in layers),
        tuple(layer[5] for layer in layers),
        f,
        n_rows,
        batch,
    )
