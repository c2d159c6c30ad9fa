"""Modules whose kernels differentiate wrongly or wastefully, in elementary form.

While either backend differentiates, the normalisations (``_rules_norm``: wrong
higher derivatives of the fused kernels), ``nn.PReLU`` (``_rules_prelu``: a wrong
batching rule under nested ``vmap``), ``nn.EmbeddingBag`` and ``nn.Hardsigmoid``
(no double backward; the latter is MobileNetV3's squeeze-excitation gate) and
``weight_norm`` (wrong gradients through ``vmap(jacrev)``) have their output
replaced by the same computation in elementary operations, through forward hooks
that live only for the call. When the engine keeps the Jacobians' graph, the
piecewise-linear activations (``ReLU``, ``LeakyReLU``, ``Hardtanh``, ``ReLU6``)
and max pooling are redone too, as selections (``_piecewise_linear``): the same
values and derivatives, and signals whose graph does not reach back to the input.
Modules that own wanted parameters are recorded
through the same forwards by the engine (``FORWARDS`` in ``_derivatives``); the
others are listed by :func:`rewritten_modules`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils.parametrizations import _WeightNorm

from ..errors import UnsupportedModuleError
from ._layer_calls import LayerCall, RecordedForward, recorded_calls
from ._piecewise_linear import PIECEWISE_LINEAR_FORWARDS
from ._rules_norm import NORM_FORWARDS
from ._rules_prelu import recorded_prelu


def recorded_embedding_bag(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, torch.Tensor]:
    """``module(input)`` for an ``nn.EmbeddingBag`` with bags as rows of ``input``.

    A lookup and a reduction over each row: ``_embedding_bag_backward`` has no
    derivative in PyTorch, so the fused kernel cannot be differentiated twice.

    Parameters
    ----------
    module : torch.nn.EmbeddingBag
        The module (``max_norm`` unset; refused elsewhere).
    args, kwargs
        The arguments of its call: ``input`` ``(batch, L)``, no ``offsets``,
        optional ``per_sample_weights`` ``(batch, L)`` (mode ``'sum'``).

    Returns
    -------
    call : LayerCall
        The call.
    output : torch.Tensor
        ``(batch, embedding_dim)``, equal to the module's output.

    Raises
    ------
    UnsupportedModuleError
        For 1-D inputs with ``offsets`` (the bags are not the batch).

    """
    m: nn.EmbeddingBag = module  # type: ignore[assignment]
    bound = dict(zip(("input", "offsets", "per_sample_weights"), args), **kwargs)
    index, weights = bound["input"], bound.get("per_sample_weights")
    if bound.get("offsets") is not None or index.dim() != 2:
        raise UnsupportedModuleError(
            "EmbeddingBag called with 1-D input and offsets: its bags are not the "
            "batch, so per-sample Jacobians are not defined. Pass a 2-D input "
            "(batch, bag size), padded with padding_idx."
        )
    rows = torch.nn.functional.embedding(index, m.weight)  # (B, L, K)
    keep = torch.ones_like(index, dtype=rows.dtype)
    if m.padding_idx is not None:
        keep = (index != m.padding_idx).to(rows.dtype)
    if weights is not None:
        rows = rows * weights[..., None]
    if m.mode == "max":
        masked = rows.masked_fill(keep[..., None] == 0, float("-inf"))
        out = masked.amax(1).nan_to_num(neginf=0.0)
    else:
        out = (rows * keep[..., None]).sum(1)
        if m.mode == "mean":
            out = out / keep.sum(1, keepdim=True).clamp(min=1)
    return LayerCall(m, tuple(args), out, kwargs, (out,)), out


def recorded_weight_norm(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, torch.Tensor]:
    """The weight of ``torch.nn.utils.parametrizations.weight_norm``: ``v · g/‖v‖``.

    PyTorch's fused ``_weight_norm`` gives wrong gradients of functions of the
    Jacobians (7 % off in the module audit); the norm is taken over every
    dimension but ``module.dim`` (all of them for ``dim=-1``).

    Parameters
    ----------
    module : torch.nn.utils.parametrizations._WeightNorm
        The parametrisation.
    args, kwargs
        ``(weight_g, weight_v)``.

    Returns
    -------
    call : LayerCall
        The call.
    output : torch.Tensor
        The weight, equal to the parametrisation's output.

    """
    g, v = args
    dim = module.dim
    if dim == -1:
        norm = v.square().sum().sqrt()
    else:
        others = tuple(d for d in range(v.dim()) if d != dim % v.dim())
        norm = v.square().sum(others, keepdim=True).sqrt()
    out = v * (g / norm)
    return LayerCall(module, tuple(args), out, kwargs, (out,)), out


def recorded_hardsigmoid(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, torch.Tensor]:
    """``nn.Hardsigmoid``: ``x/6 + 1/2`` on ``(-3, 3)``, 0 below, 1 above.

    ``hardsigmoid_backward`` has no derivative in PyTorch, so the Jacobians of a
    model with the fused kernel cannot be differentiated. At ``x = ±3`` the
    derivative is 0, as PyTorch's kernel has it.

    Parameters
    ----------
    module : torch.nn.Hardsigmoid
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
    (x,) = args
    inside = torch.where(x >= 3, 1.0, x / 6 + 0.5)
    out = torch.where(x <= -3, 0.0, inside)
    return LayerCall(module, tuple(args), out, kwargs, (out,)), out


#: Module type -> its computation in elementary operations.
ELEMENTARY_FORWARDS: dict[type[nn.Module], RecordedForward] = {
    **NORM_FORWARDS,
    nn.PReLU: recorded_prelu,
    nn.EmbeddingBag: recorded_embedding_bag,
    nn.Hardsigmoid: recorded_hardsigmoid,
    _WeightNorm: recorded_weight_norm,
}


def rewritten_modules(
    model: nn.Module, watched: Sequence[nn.Module], graph: bool = False
) -> list[nn.Module]:
    """Modules of ``model`` outside ``watched`` with an elementary form.

    Their output is redone with elementary operations while recording, so that
    the Jacobians and their derivatives through them are right.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    watched : sequence of torch.nn.Module
        Modules recorded by the engine (left out here).
    graph : bool, default=False
        The caller keeps the Jacobians' graph (``enable_backprop``): the
        piecewise-linear activations and max pooling are listed too, so that no
        derivative of the Jacobians sends zeros back through their selections.
        Without a graph they would only add a pass over each such module.

    Returns
    -------
    list of torch.nn.Module

    """
    seen = {id(m) for m in watched}
    kinds = set(ELEMENTARY_FORWARDS)
    if graph:
        kinds |= set(PIECEWISE_LINEAR_FORWARDS)
    return [m for m in model.modules() if type(m) in kinds and id(m) not in seen]


@contextmanager
def elementary_forms(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s modules with an elementary form run in it.

    For ``torch.func`` transforms of the model (``DiffFuncGGN``). The forward hooks
    live only inside the block.

    Yields
    ------
    None

    """
    with recorded_calls([], ELEMENTARY_FORWARDS, rewritten_modules(model, [])):
        yield
