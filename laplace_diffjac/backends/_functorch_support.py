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

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ..errors import UnsupportedModuleError
from ..jacobians._functorch_refusals import functorch_refusals

#: Module types that ``vmap`` over samples cannot run.
SAMPLE_BY_SAMPLE = (nn.RNNBase, nn.RNNCellBase)

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
def quiet_batching_fallbacks() -> Iterator[None]:
    """Silence PyTorch's "performance drop" notice of ``vmap``'s loop, for the call.

    Yields
    ------
    None

    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="There is a performance drop because we have not yet "
            "implemented the batching rule",
            category=UserWarning,
        )
        yield
