"""Record the inputs and outputs of chosen modules during one forward pass.

The hooks live only inside :func:`recorded_calls`; their handles are local to the
call, so nothing process-global (such as BackPACK's ``CTX``) is involved and nothing
is left on the modules afterwards. Each call remembers the version counters of its
tensors, so that a later in-place write into them is seen (``_in_place``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ._in_place import copied, tensors_in, versions, works_in_place


@dataclass(frozen=True)
class LayerCall:
    """One call of a module during a forward pass.

    Attributes
    ----------
    module : torch.nn.Module
        The module that was called.
    inputs : tuple
        Its positional inputs, graph-connected.
    output : torch.Tensor
        Its output (the first element for modules that return tuples).
    kwargs : dict
        Its keyword inputs (attention masks, for instance).
    outputs : tuple of torch.Tensor
        Every tensor the module returned, depth first (``output`` first); the
        recurrent rules need the final states too.
    versions : tuple of int
        Version counters of :meth:`tensors` when the call was recorded.

    """

    module: nn.Module
    inputs: tuple
    output: torch.Tensor
    kwargs: dict = field(default_factory=dict)
    outputs: tuple[torch.Tensor, ...] = ()
    versions: tuple[int, ...] = ()

    def signal_targets(self) -> tuple[torch.Tensor, ...]:
        """Tensors the output signals are sent to: all outputs, or ``output``."""
        return self.outputs if self.outputs else (self.output,)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the call holds: inputs, keyword inputs, signal targets."""
        held = (self.inputs, self.kwargs, self.signal_targets())
        return tuple(tensors_in(held))

    def modified_in_place(self) -> bool:
        """Whether a tensor of the call was written into in place after it."""
        return versions(self.tensors()) != self.versions


#: ``forward(module, args, kwargs) -> (call, output)``: the module's computation
#: redone so that the call records intermediate tensors; ``output`` replaces the
#: module's own (equal in value).
RecordedForward = Callable[[nn.Module, tuple, dict], tuple["LayerCall", object]]


@contextmanager
def recorded_calls(
    modules: Sequence[nn.Module],
    forwards: Mapping[type[nn.Module], RecordedForward] | None = None,
    rewritten: Sequence[nn.Module] = (),
    copied_calls: Collection[int] = (),
) -> Iterator[list[LayerCall]]:
    """Record every call of ``modules`` made inside the ``with`` block.

    Parameters
    ----------
    modules : sequence of torch.nn.Module
        Modules to watch. A module called twice (shared weights) is recorded twice.
    forwards : mapping, optional
        Module type -> :data:`RecordedForward` for types whose rule needs signals
        inside the module (attention); their output is replaced by the redone one.
    rewritten : sequence of torch.nn.Module, optional
        Further modules (not in ``modules``) whose output is replaced by the one
        redone by ``forwards`` without recording the call: parameterless
        normalisations, whose fused kernels have wrong higher derivatives. One
        that works in place (``inplace=True``) is redone from a copy of its input
        taken before the call.
    copied_calls : collection of int, optional
        ``id`` of modules in ``modules`` whose inputs are copied before each call
        and whose output is copied after it, so that in-place writes of the model
        into them leave the recorded tensors as they were (see ``_in_place``).

    Yields
    ------
    list of LayerCall
        Filled in call order while the block runs.

    """
    calls: list[LayerCall] = []
    forwards = forwards or {}
    before: dict[int, list[tuple]] = {}  # inputs of in-place rewritten modules

    def hook(module: nn.Module, inputs: tuple, kwargs: dict, output: object) -> object:
        forward = forwards.get(type(module))
        if forward is not None:
            call, replaced = forward(module, tuple(inputs), kwargs)
        else:
            replaced = _apart(output)
            tensors = tuple(tensors_in(output if replaced is None else replaced))
            call = LayerCall(module, tuple(inputs), tensors[0], kwargs, tensors)
        calls.append(replace(call, versions=versions(call.tensors())))
        if id(module) in copied_calls:
            return copied(output if replaced is None else replaced)
        return replaced

    def copy_inputs(_: nn.Module, args: tuple, kwargs: dict) -> tuple:
        return tuple(copied(a) for a in args), {k: copied(v) for k, v in kwargs.items()}

    def keep_input(module: nn.Module, args: tuple) -> None:
        before.setdefault(id(module), []).append(tuple(copied(a) for a in args))

    def rewrite(module: nn.Module, inputs: tuple, kwargs: dict, _: object) -> object:
        kept = before.get(id(module))
        if kept:
            inputs = kept.pop()
        return forwards[type(module)](module, tuple(inputs), kwargs)[1]

    handles = [
        m.register_forward_pre_hook(copy_inputs, with_kwargs=True)
        for m in modules
        if id(m) in copied_calls
    ]
    handles += [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    handles += [
        m.register_forward_pre_hook(keep_input) for m in rewritten if works_in_place(m)
    ]
    handles += [m.register_forward_hook(rewrite, with_kwargs=True) for m in rewritten]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _apart(output: object) -> object | None:
    """A module's output of several tensors, each behind a view of its own.

    The signal at a returned tensor is then the derivative along the model's own
    uses of that tensor only: in a module that computes one output from another
    (an ``LSTMCell`` whose ``h`` is computed from its ``c``), the total
    derivative at ``c`` would count the path through ``h`` twice.

    Returns
    -------
    object or None
        The same structure with every tensor that requires grad replaced by a
        view of it; ``None`` if fewer than two do (nothing to replace).

    """
    if sum(t.requires_grad for t in tensors_in(output)) < 2:
        return None
    return tree_map(
        lambda t: (
            t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t
        ),
        output,
    )
