"""What ``DiffFuncGGN`` refuses before any work, and how it runs what it accepts.

``torch.func`` traces any module, but a few compute something other than a
per-sample function of their input (or change the model while they run); those
are refused here, by name, with the route that works. Cells of recurrent
networks are run sample by sample (under ``vmap`` they create their zero state
unbatched and write the batched result into it), and the notices PyTorch prints
when ``vmap`` falls back to a loop for an operator without a batching rule
(``EmbeddingBag``, ``Bilinear``, ``weight_norm``) are kept quiet: those loops
are correct, only slower (the module audit checks them against a per-sample
autograd loop).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModuleError
from ..jacobians._functorch_refusals import functorch_refusals
from ..jacobians._rules_recurrent import SAMPLE_BY_SAMPLE, refuse_packed_sequence
from ..jacobians._warnings import quiet_batching_fallbacks

__all__ = [
    "SAMPLE_BY_SAMPLE",
    "check_functorch_support",
    "quiet_batching_fallbacks",
    "refused_packed_sequences",
    "runs_sample_by_sample",
    "sample_loop",
    "without_onednn",
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


def runs_sample_by_sample(model: nn.Module) -> bool:
    """Whether ``model`` holds a recurrent layer or cell (see the module docstring).

    Returns
    -------
    bool

    """
    return any(isinstance(m, SAMPLE_BY_SAMPLE) for m in model.modules())


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


@contextmanager
def without_onednn() -> Iterator[None]:
    """Run recurrent layers on ATen's kernels, not oneDNN's, for this call only.

    oneDNN's ``mkldnn_rnn_layer`` (float32 on CPU) has no ``torch.func`` backward
    ("undefined Tensor ... 'workspace'"). ``torch.backends.mkldnn.flags`` would do
    the same but warns about TF32 on every use.
    """
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def sample_loop(
    jac_and_value: Any,
    params: dict[str, torch.Tensor],
    x: Any,
    selected: torch.Tensor | None,
    batch: int,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``vmap(jac_and_value)`` as a loop over samples, stacked the same way.

    Returns
    -------
    dict of torch.Tensor
        Per parameter name, the stacked first results.
    torch.Tensor
        The stacked second results.

    """
    results = [
        jac_and_value(
            params,
            {k: v[i] for k, v in x.items()} if isinstance(x, Mapping) else x[i],
            None if selected is None else selected[i],
        )
        for i in range(batch)
    ]
    jac = {name: torch.stack([r[0][name] for r in results]) for name in params}
    return jac, torch.stack([r[1] for r in results])
