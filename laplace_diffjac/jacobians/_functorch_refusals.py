"""Modules that ``DiffFuncGGN`` refuses, decided on the module alone.

They compute something other than a per-sample function of their input, or change
the model while they run, so no per-sample Jacobian exists for ``torch.func`` to
find. The BackPACK backends consult this too, so that they only send a user to
``DiffFuncGGN`` where it works.
"""

from __future__ import annotations

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
