"""Record the inputs and outputs of chosen modules during one forward pass.

The hooks live only inside :func:`recorded_calls`; their handles are local to the
call, so nothing process-global (such as BackPACK's ``CTX``) is involved and nothing
is left on the modules afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LayerCall:
    """One call of a module during a forward pass.

    Attributes
    ----------
    module : torch.nn.Module
        The module that was called.
    inputs : tuple of torch.Tensor
        Its positional inputs, graph-connected.
    output : torch.Tensor
        Its output (the first element for modules that return tuples).

    """

    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor


@contextmanager
def recorded_calls(modules: Sequence[nn.Module]) -> Iterator[list[LayerCall]]:
    """Record every call of ``modules`` made inside the ``with`` block.

    Parameters
    ----------
    modules : sequence of torch.nn.Module
        Modules to watch. A module called twice (shared weights) is recorded twice.

    Yields
    ------
    list of LayerCall
        Filled in call order while the block runs.

    """
    calls: list[LayerCall] = []

    def hook(module: nn.Module, inputs: tuple, output: object) -> None:
        first = output[0] if isinstance(output, (tuple, list)) else output
        calls.append(LayerCall(module, tuple(inputs), first))

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
