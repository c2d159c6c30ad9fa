"""Record the inputs and outputs of chosen modules during one forward pass.

The hooks live only inside :func:`recorded_calls`; their handles are local to the
call, so nothing process-global (such as BackPACK's ``CTX``) is involved and nothing
is left on the modules afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


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

    """

    module: nn.Module
    inputs: tuple
    output: torch.Tensor
    kwargs: dict = field(default_factory=dict)
    outputs: tuple[torch.Tensor, ...] = ()

    def signal_targets(self) -> tuple[torch.Tensor, ...]:
        """Tensors the output signals are sent to: all outputs, or ``output``."""
        return self.outputs if self.outputs else (self.output,)


#: ``forward(module, args, kwargs) -> (call, output)``: the module's computation
#: redone so that the call records intermediate tensors; ``output`` replaces the
#: module's own (equal in value).
RecordedForward = Callable[[nn.Module, tuple, dict], tuple["LayerCall", object]]


@contextmanager
def recorded_calls(
    modules: Sequence[nn.Module],
    forwards: Mapping[type[nn.Module], RecordedForward] | None = None,
    rewritten: Sequence[nn.Module] = (),
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
        normalisations, whose fused kernels have wrong higher derivatives.

    Yields
    ------
    list of LayerCall
        Filled in call order while the block runs.

    """
    calls: list[LayerCall] = []
    forwards = forwards or {}

    def hook(module: nn.Module, inputs: tuple, kwargs: dict, output: object) -> object:
        forward = forwards.get(type(module))
        if forward is not None:
            call, replaced = forward(module, tuple(inputs), kwargs)
            calls.append(call)
            return replaced
        tensors = tuple(_tensors(output))
        calls.append(LayerCall(module, tuple(inputs), tensors[0], kwargs, tensors))
        return None

    def rewrite(module: nn.Module, inputs: tuple, kwargs: dict, _: object) -> object:
        return forwards[type(module)](module, tuple(inputs), kwargs)[1]

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    handles += [m.register_forward_hook(rewrite, with_kwargs=True) for m in rewritten]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _tensors(output: object) -> Iterator[torch.Tensor]:
    """The tensors of a (nested tuple) module output, depth first."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
