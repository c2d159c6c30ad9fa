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
from typing import Any

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
    expanded_calls: Collection[int] = (),
    batch: int = 1,
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
    expanded_calls : collection of int, optional
        ``id`` of modules in ``modules`` whose inputs and outputs that lead with
        1 are expanded to ``batch`` (a module called on an input shared by the
        batch; see ``_forward``).
    batch : int, optional
        The batch size, for ``expanded_calls``.

    Yields
    ------
    list of LayerCall
        Filled in call order while the block runs.

    """
    recorder = _Recorder(
        dict(forwards or {}), set(copied_calls), set(expanded_calls), batch
    )
    handles = recorder.install(modules, rewritten)
    try:
        yield recorder.calls
    finally:
        for handle in handles:
            handle.remove()


class _Recorder:
    """The hooks of one :func:`recorded_calls` block and what they keep."""

    def __init__(
        self,
        forwards: dict[type[nn.Module], RecordedForward],
        copied_calls: set[int],
        expanded_calls: set[int],
        batch: int,
    ) -> None:
        self.calls: list[LayerCall] = []
        self.forwards = forwards
        self.copied_calls = copied_calls
        self.expanded_calls = expanded_calls
        self.batch = batch
        self.before: dict[int, list[tuple]] = {}  # inputs of in-place rewrites

    def install(
        self, modules: Sequence[nn.Module], rewritten: Sequence[nn.Module]
    ) -> list[Any]:
        """Register the hooks; return their handles."""
        adjusted = self.copied_calls | self.expanded_calls
        handles = [
            m.register_forward_pre_hook(self.adjust_inputs, with_kwargs=True)
            for m in modules
            if id(m) in adjusted
        ]
        handles += [
            m.register_forward_hook(self.record, with_kwargs=True) for m in modules
        ]
        handles += [
            m.register_forward_pre_hook(self.keep_input)
            for m in rewritten
            if works_in_place(m)
        ]
        handles += [
            m.register_forward_hook(self.rewrite, with_kwargs=True) for m in rewritten
        ]
        return handles

    def record(
        self, module: nn.Module, inputs: tuple, kwargs: dict, output: object
    ) -> object:
        """Forward hook of a watched module: record the call, maybe replace."""
        forward = self.forwards.get(type(module))
        if forward is not None:
            call, replaced = forward(module, tuple(inputs), kwargs)
            call = replace(call, versions=versions(call.tensors()))
        else:
            if id(module) in self.expanded_calls:
                output = _expanded(output, self.batch)
            replaced = _apart(output)
            if replaced is None and id(module) in self.expanded_calls:
                replaced = output
            tensors = tuple(tensors_in(output if replaced is None else replaced))
            inputs = tuple(inputs)
            seen = versions(tensors_in((inputs, kwargs, tensors)))  # call.tensors()
            call = LayerCall(module, inputs, tensors[0], kwargs, tensors, seen)
        self.calls.append(call)
        if id(module) in self.copied_calls:
            return copied(output if replaced is None else replaced)
        return replaced

    def adjust_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        """Forward pre-hook: copies and/or expansions of the inputs."""
        if id(module) in self.expanded_calls:
            args, kwargs = _expanded((tuple(args), kwargs), self.batch)
        if id(module) in self.copied_calls:
            args = tuple(copied(a) for a in args)
            kwargs = {k: copied(v) for k, v in kwargs.items()}
        return tuple(args), kwargs

    def keep_input(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of an in-place rewritten module: keep its input."""
        kept = tuple(copied(a) for a in args)
        self.before.setdefault(id(module), []).append(kept)

    def rewrite(
        self, module: nn.Module, inputs: tuple, kwargs: dict, _: object
    ) -> object:
        """Forward hook of a rewritten module: its output in elementary form."""
        kept = self.before.get(id(module))
        if kept:
            inputs = kept.pop()
        return self.forwards[type(module)](module, tuple(inputs), kwargs)[1]


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
    if isinstance(output, torch.Tensor):  # one tensor: nothing to set apart
        return None
    if sum(t.requires_grad for t in tensors_in(output)) < 2:
        return None
    return tree_map(
        lambda t: (
            t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t
        ),
        output,
    )


def _expanded(obj: Any, batch: int) -> Any:
    """``obj`` with every tensor of first dimension 1 expanded to ``batch`` (views)."""
    return tree_map(
        lambda t: (
            t.expand(batch, *t.shape[1:])
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == 1
            else t
        ),
        obj,
    )
