"""What ``DiffFuncGGN`` refuses, decided on the modules alone.

Some modules compute something other than a per-sample function of their input, or
change the model while they run, so no per-sample Jacobian exists for
``torch.func`` to find; and its ``kron`` (curvlinops' KFAC) factorises
``nn.Linear``/``nn.Conv2d`` parameters only. The BackPACK backends consult this
too, so that their errors send a user to ``DiffFuncGGN`` only where it works.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

_NORMS_WITH_RUNNING_STATS = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)


def functorch_refusal(module: nn.Module) -> str | None:
    """Why ``torch.func`` cannot give ``module``'s per-sample Jacobians, or ``None``.

    Returns
    -------
    str or None
        The module type, what goes wrong and the fix.

    """
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        kind = type(module).__name__
        if module.max_norm is not None:
            return (
                f"{kind} with max_norm: its forward renormalises the weight in "
                "place; renormalise once yourself (torch.embedding_renorm_) and "
                "set max_norm=None"
            )
        if module.scale_grad_by_freq:
            return (
                f"{kind} with scale_grad_by_freq: its gradient is rescaled by the "
                "batch's token counts, not a derivative; set "
                "scale_grad_by_freq=False"
            )
    if module.training and _dropout(module) > 0:
        return (
            f"{type(module).__name__} with active dropout: every call is random; "
            "call model.eval()"
        )
    if isinstance(module, _NORMS_WITH_RUNNING_STATS) and module.training:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return (
                f"{type(module).__name__} in training mode: batch statistics couple "
                "the samples; call model.eval()"
            )
        if module.track_running_stats:
            return (
                f"{type(module).__name__} in training mode with "
                "track_running_stats=True updates its statistics at every call; "
                "call model.eval()"
            )
    return None


def _dropout(module: nn.Module) -> float:
    """The dropout probability ``module`` applies itself (0 if none)."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p
    if isinstance(module, nn.MultiheadAttention):
        return module.dropout
    if isinstance(module, nn.RNNBase) and module.num_layers > 1:
        return module.dropout
    return 0.0


def functorch_refusals(model: nn.Module) -> list[str]:
    """``'name (reason)'`` for every module of ``model`` that ``DiffFuncGGN`` refuses.

    Returns
    -------
    list of str

    """
    return [
        f"{name or '<root>'} ({reason})"
        for name, module in model.named_modules()
        if (reason := functorch_refusal(module)) is not None
    ]


def kfac_refusals(model: nn.Module, params: Sequence[torch.Tensor]) -> list[str]:
    """Modules owning some of ``params`` that curvlinops' KFAC cannot factorise.

    Returns
    -------
    list of str
        ``'name (type)'``, sorted; empty if every parameter belongs to an
        ``nn.Linear`` or an ``nn.Conv2d`` with groups 1 and zero padding.

    """
    wanted = {id(p) for p in params}
    refused = []
    for name, module in model.named_modules():
        if not any(id(p) in wanted for p in module.parameters(recurse=False)):
            continue
        if isinstance(module, nn.Conv2d) and (
            module.groups != 1
            or isinstance(module.padding, str)
            or module.padding_mode != "zeros"
        ):
            refused.append(
                f"{name} (Conv2d with groups, string padding or non-zero padding mode)"
            )
        elif not isinstance(module, (nn.Linear, nn.Conv2d)):
            refused.append(f"{name or '<root>'} ({type(module).__name__})")
    return sorted(refused)
