"""What ``DiffFuncGGN`` refuses before any work, and what it keeps quiet.

``torch.func`` traces any module, but a few compute something other than a
per-sample function of their input (or change the model while they run); those
are refused here, by name, with the route that works (how the batch is mapped,
``vmap`` or a loop, is ``_functorch_routes``). The notices PyTorch prints
when ``vmap`` falls back to a loop for an operator without a batching rule
(``EmbeddingBag``, ``Bilinear``, ``weight_norm``) are kept quiet: those loops
are correct, only slower (the module audit checks them against a per-sample
autograd loop).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ..errors import UnsupportedModuleError
from ..jacobians._functorch_refusals import functorch_refusals
from ..jacobians._rules_recurrent import refuse_packed_sequence
from ..jacobians._warnings import quiet_batching_fallbacks

__all__ = [
    "check_functorch_support",
    "quiet_batching_fallbacks",
    "refused_packed_sequences",
]


def check_functorch_support(model: nn.Module) -> None:
    """Refuse modules whose per-sample Jacobians ``torch.func`` cannot give.

    Raises
    ------
    UnsupportedModuleError
        Naming the module and the fix.

    """
    refused = functorch_refusals(model)
    if refused:
        raise UnsupportedModuleError(
            f"DiffFuncGGN refuses {', '.join(refused)}; no backend of this "
            "package takes them as they are. The model was not run."
        )


@contextmanager
def refused_packed_sequences(model: nn.Module) -> Iterator[None]:
    """Inside the block, a recurrent layer called with a ``PackedSequence`` raises.

    Forward pre-hooks that live only for the block.

    Yields
    ------
    None

    """

    def check(module: nn.Module, args: tuple) -> None:
        refuse_packed_sequence(module, args)

    handles = [
        m.register_forward_pre_hook(check)
        for m in model.modules()
        if isinstance(m, nn.RNNBase)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
