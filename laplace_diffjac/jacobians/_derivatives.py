"""Per-sample parameter Jacobians of single modules, for all outputs at once.

Given the gradients of V scalar-per-sample functions with respect to a module's
output, ``(V, batch, *output_shape)``, describe the per-sample gradients with
respect to its parameters as factors for :func:`.jacobian_blocks.assemble`.
``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` (groups 1, zero padding) use a closed
form (signals times inputs), which is never materialised before it is written into
the final Jacobian; so do the types in :data:`RULES` (Embedding as a scatter, norms,
attention, recurrent layers) and Hugging Face's ``Conv1D``. The module types that
BackPACK's ``BatchGrad`` supports go through BackPACK's derivatives object
(``param_mjp``), with BackPACK's bookkeeping attributes (``input0``, ``output``) on
the module only for the duration of one call. Every other module holding parameters
(of your own, or from another library) gets the local rule (``_rules_local``): the
module alone, differentiated sample by sample with ``torch.func``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch
from backpack.core.derivatives.basederivatives import BaseParameterDerivatives
from backpack.core.derivatives.batchnorm_nd import BatchNormNdDerivatives
from backpack.core.derivatives.conv1d import Conv1DDerivatives
from backpack.core.derivatives.conv2d import Conv2DDerivatives
from backpack.core.derivatives.conv3d import Conv3DDerivatives
from backpack.core.derivatives.conv_transpose1d import ConvTranspose1DDerivatives
from backpack.core.derivatives.conv_transpose2d import ConvTranspose2DDerivatives
from backpack.core.derivatives.conv_transpose3d import ConvTranspose3DDerivatives
from backpack.core.derivatives.linear import LinearDerivatives
from torch import nn
from torch.nn.utils import parametrize

from ..errors import UnsupportedModuleError
from . import _rules_attention, _rules_embedding, _rules_recurrent
from ._assembly import Dense, Factors, Product, Summed
from ._elementary import ELEMENTARY_FORWARDS
from ._functorch_refusals import functorch_refusal
from ._layer_calls import LayerCall, RecordedForward
from ._piecewise_linear import PIECEWISE_LINEAR_FORWARDS
from ._rules_conv import (
    PADDED_CONVS,
    batch_first,
    conv_factors,
    has_closed_form_conv,
)
from ._rules_conv1d import conv1d_factors, is_hf_conv1d
from ._rules_local import local_factors
from ._rules_norm import INSTANCE_NORMS, group_norm_factors, layer_norm_factors
from ._rules_prelu import prelu_factors

Signals = tuple[Optional[torch.Tensor], ...]
Rule = Callable[[LayerCall, Signals, set[int]], list[tuple[int, Factors]]]

#: Module types with a rule of their own (closed form, a scatter for Embedding, or
#: BPTT for recurrent layers); a ``MultiheadAttention`` also owns its ``out_proj``
#: parameters.
RULES: dict[type[nn.Module], Rule] = {
    nn.Embedding: _rules_embedding.embedding_factors,
    nn.LayerNorm: layer_norm_factors,
    nn.GroupNorm: group_norm_factors,
    **{t: group_norm_factors for t in INSTANCE_NORMS},
    nn.PReLU: prelu_factors,
    nn.MultiheadAttention: _rules_attention.attention_factors,
    **{t: _rules_recurrent.recurrent_factors for t in _rules_recurrent.RECURRENT},
}


def rule_for(module: nn.Module) -> Rule | None:
    """The rule of ``module``'s type, Hugging Face's ``Conv1D`` included, or ``None``.

    Returns
    -------
    Rule or None

    """
    if is_hf_conv1d(module):
        return conv1d_factors
    return RULES.get(type(module))


#: Module types whose computation is redone while recording (see
#: :func:`.layer_calls.recorded_calls`), so that their rule gets signals inside.
FORWARDS: dict[type[nn.Module], RecordedForward] = {
    nn.MultiheadAttention: _rules_attention.recorded_forward,
    **ELEMENTARY_FORWARDS,
    **PIECEWISE_LINEAR_FORWARDS,
}


#: Module types with a per-sample Jacobian rule (those of BackPACK's ``BatchGrad``
#: that take a single batch-first input).
DERIVATIVES: dict[type[nn.Module], BaseParameterDerivatives] = {
    nn.Linear: LinearDerivatives(),
    nn.Conv1d: Conv1DDerivatives(),
    nn.Conv2d: Conv2DDerivatives(),
    nn.Conv3d: Conv3DDerivatives(),
    nn.ConvTranspose1d: ConvTranspose1DDerivatives(),
    nn.ConvTranspose2d: ConvTranspose2DDerivatives(),
    nn.ConvTranspose3d: ConvTranspose3DDerivatives(),
    nn.BatchNorm1d: BatchNormNdDerivatives(),
    nn.BatchNorm2d: BatchNormNdDerivatives(),
    nn.BatchNorm3d: BatchNormNdDerivatives(),
}

_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

#: Module types whose rules find the batch dimension themselves.
_SEQUENCE_AWARE = (nn.MultiheadAttention, *_rules_recurrent.RECURRENT)


def owning_modules(root: nn.Module, params: Sequence[torch.Tensor]) -> list[nn.Module]:
    """Return the modules that own ``params`` directly, checking each is supported.

    Parameters
    ----------
    root : torch.nn.Module
        Model whose submodules are searched.
    params : sequence of torch.Tensor
        Parameters the Jacobian is taken with respect to.

    Returns
    -------
    list of torch.nn.Module
        Owners in ``root.modules()`` order, each listed once.

    Raises
    ------
    UnsupportedModuleError
        If a parameter is owned by a module without a Jacobian rule, or by none, or
        if a BatchNorm layer is in training mode.

    """
    wanted = {id(p) for p in params}
    owners: list[nn.Module] = []
    found: set[int] = set()
    unsupported: list[str] = []
    inside: set[int] = set()  # submodules of modules whose rule owns them
    for name, module in root.named_modules():
        if id(module) in inside:
            continue
        recurse = isinstance(module, nn.MultiheadAttention)
        held = (
            module.parameters() if recurse else module._parameters.values()
        )  # the registry itself: parameters(recurse=False) costs three generators
        own = [p for p in held if p is not None and id(p) in wanted]
        if not own:
            continue
        if recurse:
            inside.update(id(m) for m in module.modules() if m is not module)
        found.update(id(p) for p in own)
        reason = _refusal(module, name)
        if reason is not None:
            unsupported.append(f"{name or '<root>'} ({reason}: {_route(module)})")
            continue
        owners.append(module)
    if unsupported:
        raise UnsupportedModuleError(
            "The BackPACK backends have no per-sample Jacobian rule for the "
            f"parameterised module(s) {'; '.join(unsupported)}. Other modules, "
            "with parameters or without (your own, other libraries'), are fine: "
            "those without a rule of their own are differentiated on their own, "
            "sample by sample."
        )
    if len(found) != len(wanted):
        raise UnsupportedModuleError(
            "Some trainable parameters do not belong to a submodule of the model "
            "that is differentiated; use laplace_diffjac.DiffFuncGGN."
        )
    return owners


def check_batch_first(calls: Iterable[LayerCall], batch: int, root: nn.Module) -> None:
    """Refuse a call whose output does not lead with the batch.

    Every rule but attention's and the recurrent ones (which honour ``batch_first``)
    takes the first dimension of a module's output as the batch; any other layout
    would mix the samples' signals.

    Raises
    ------
    UnsupportedModuleError
        Naming the module, its leading size and the usual causes.

    """
    for call in calls:
        if isinstance(call.module, nn.RNNBase):
            _rules_recurrent.refuse_packed_sequence(call.module, call.inputs)
        if isinstance(call.module, _SEQUENCE_AWARE):
            continue
        lead = call.output.shape[0] if call.output.dim() else 1
        if lead != batch:
            names = {id(m): name for name, m in root.named_modules()}
            name = names.get(id(call.module)) or "<root>"
            raise UnsupportedModuleError(
                f"Module '{name}' ({type(call.module).__name__}) returned a tensor "
                f"whose first dimension is {lead}, not the batch size {batch}, so "
                "its per-sample Jacobians cannot be told apart. Usual causes: a "
                "sequence-first layout (use batch_first=True), or the batch "
                "merged with other dimensions (an input shared by the whole "
                "batch, of first dimension 1, is taken care of). "
                "laplace_diffjac.DiffFuncGGN handles any layout."
            )


def shared_by_batch(call: LayerCall, batch: int) -> bool:
    """Whether ``call`` returned one output for a batch of several samples.

    A module called on an input shared by the batch (position ids ``(1, T)``),
    whose output the model broadcasts; attention and the recurrent layers find
    the batch themselves and are never taken as shared.

    Returns
    -------
    bool

    """
    if batch < 2 or isinstance(call.module, _SEQUENCE_AWARE):
        return False
    return call.output.dim() > 0 and call.output.shape[0] == 1


def _route(module: nn.Module) -> str:
    """What works instead: ``DiffFuncGGN`` where it does, else the fix."""
    elsewhere = functorch_refusal(module)
    if elsewhere is None and isinstance(module, nn.EmbeddingBag):
        return "use laplace_diffjac.DiffFuncGGN, with one bag per row of a 2-D input"
    if elsewhere is None:
        return "use laplace_diffjac.DiffFuncGGN for this model"
    return f"no backend takes it as it is; {elsewhere.split(': ', 1)[-1]}"


def uses_local_rule(module: nn.Module) -> bool:
    """Whether ``module`` has no rule of its own (see ``_rules_local``).

    Returns
    -------
    bool
        For types without a closed form, a rule or BackPACK derivatives, and for
        convolutions whose padding mode BackPACK's derivatives do not take.

    """
    kind = type(module)
    if kind in PADDED_CONVS and not has_closed_form_conv(module):
        return module.padding_mode != "zeros"
    return kind not in DERIVATIVES and rule_for(module) is None


def _refusal(module: nn.Module, name: str) -> str | None:
    """Why ``module`` has no rule (``None`` if it has one); raise for BatchNorm."""
    kind = type(module)
    if isinstance(module, parametrize.ParametrizationList):
        # its call computes a weight shared by all samples, not a batch
        return (
            f"{kind.__name__} (a weight computed by torch.nn.utils.parametrize, "
            "such as weight_norm)"
        )
    if uses_local_rule(module):
        return None
    if isinstance(module, _BATCHNORM) and module.training:
        raise UnsupportedModuleError(
            f"{kind.__name__} layer '{name}' is in training mode, where per-sample "
            "Jacobians are not defined (the batch statistics couple the samples). "
            "Call model.eval() first."
        )
    if isinstance(module, INSTANCE_NORMS) and module.training:
        if module.track_running_stats:
            raise UnsupportedModuleError(
                f"{kind.__name__} layer '{name}' is in training mode with "
                "track_running_stats=True, so every call updates its running "
                "statistics. Call model.eval() first."
            )
    if isinstance(module, nn.Embedding):
        return _rules_embedding.unsupported_reason(module)
    if isinstance(module, nn.MultiheadAttention):
        return _rules_attention.unsupported_reason(module)
    if isinstance(module, _rules_recurrent.RECURRENT):
        return _rules_recurrent.unsupported_reason(module)
    return None


def param_jacobian_factors(
    calls: Iterable[LayerCall],
    output_grads: Sequence[Signals],
    params: Sequence[torch.Tensor],
) -> dict[int, list[Factors]]:
    """Map batched output signals of each module call to Jacobian factors.

    ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` (groups 1, zero padding) give
    closed-form factors that :func:`.jacobian_blocks.assemble` writes straight into
    the final Jacobian, and so do the types in :data:`RULES` (Embedding, norms,
    attention, recurrent layers); every other module gives a block from BackPACK's
    ``param_mjp``.

    Parameters
    ----------
    calls : iterable of LayerCall
        Recorded module calls.
    output_grads : sequence of tuple of (torch.Tensor or None)
        For each call, one entry per tensor it returned (``LayerCall.outputs``),
        ``(V, *output_shape)``: the gradient of each of V scalar-per-sample
        functions with respect to that output; ``None`` where the output does not
        influence them.
    params : sequence of torch.Tensor
        Parameters of interest; others owned by the modules are skipped.

    Returns
    -------
    dict
        ``id(param) -> [factors, ...]``, one entry per call that contributes
        (several for a shared module). Parameters without any contribution are
        absent.

    """
    wanted = {id(p) for p in params}
    result: dict[int, list[Factors]] = {}
    for call, grads in zip(calls, output_grads):
        if all(g is None for g in grads):
            continue
        grad = grads[0]
        if type(call.module) is nn.Linear:  # the common case first: no rule
            if grad is None:
                continue
            blocks = _linear_factors(call, grad, wanted)
        elif (rule := rule_for(call.module)) is not None:
            blocks = rule(call, grads, wanted)
        elif uses_local_rule(call.module):
            blocks = local_factors(call, grads, wanted)
        elif grad is None:
            continue
        elif has_closed_form_conv(call.module):
            blocks = conv_factors(call, grad, wanted)
        else:
            blocks = _backpack_blocks(call, grad, wanted)
        for key, factors in blocks:
            result.setdefault(key, []).append(factors)
    return result


def _linear_factors(
    call: LayerCall, grad: torch.Tensor, wanted: set[int]
) -> list[tuple[int, Factors]]:
    """Closed-form ``nn.Linear`` factors.

    With signals ``g`` ``(V, batch, *, out)`` and inputs ``a`` ``(batch, *, in)``,
    the weight block of sample ``b`` is ``Σ_t g[v, b, t] ⊗ a[b, t]`` (an outer
    product when there are no extra dimensions ``*``) and the bias block
    ``Σ_t g[v, b, t]``.

    Returns
    -------
    list of (int, Factors)
        ``Product`` factors of the weight and ``Summed`` factors of the bias, keyed
        by the parameters' ``id`` (only those in ``wanted``).

    """
    module = call.module
    n_rows, batch, n_out = grad.shape[0], grad.shape[1], grad.shape[-1]
    g = grad.reshape(n_rows, batch, -1, n_out).transpose(2, 3)  # (V, B, out, T)
    blocks: list[tuple[int, Factors]] = []
    if id(module.weight) in wanted:
        a = call.inputs[0].reshape(batch, -1, module.in_features)  # (B, T, in)
        blocks.append((id(module.weight), Product(batch_first(g), a)))
    if module.bias is not None and id(module.bias) in wanted:
        blocks.append((id(module.bias), Summed(g)))
    return blocks


def _backpack_blocks(
    call: LayerCall, grad: torch.Tensor, wanted: set[int]
) -> list[tuple[int, Factors]]:
    """BackPACK's ``param_mjp`` per parameter, as ``(V, batch, numel)`` blocks."""
    module = call.module
    derivatives = DERIVATIVES[type(module)]
    saved: dict[str, Any] = {
        k: vars(module)[k] for k in ("input0", "output") if k in vars(module)
    }
    vars(module)["input0"] = call.inputs[0]
    vars(module)["output"] = call.output
    blocks: list[tuple[int, Factors]] = []
    try:
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in wanted:
                continue
            jac = derivatives.param_mjp(
                name, module, None, (grad[0],), grad, sum_batch=False
            )
            n_rows, batch = jac.shape[:2]
            blocks.append((id(param), Dense(jac.reshape(n_rows, batch, -1))))
    finally:
        for key in ("input0", "output"):
            vars(module).pop(key, None)
        vars(module).update(saved)
    return blocks
