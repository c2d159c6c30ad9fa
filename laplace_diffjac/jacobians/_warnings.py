"""The PyTorch warnings this package silences, and only inside its own calls."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

_NO_INPUT_GRAD = "Full backward hook is firing when gradients are computed"
_BATCHING_LOOP = (
    "There is a performance drop because we have not yet implemented the batching rule"
)


@contextmanager
def quiet_full_backward_hook_warning() -> Iterator[None]:
    """Silence PyTorch's note that a full backward hook fired on output gradients.

    It fires when BackPACK's hooks (ours, or those of a model the user extended) sit
    on a module whose inputs need no gradient, e.g. the first layer when the input is
    data. BackPACK's first-order and second-order rules only need output gradients
    there, so the note carries no information for these calls.

    Yields
    ------
    None

    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_INPUT_GRAD)
        yield


@contextmanager
def quiet_batching_fallbacks() -> Iterator[None]:
    """Silence PyTorch's "performance drop" notice of ``vmap``'s loop, for the call.

    ``vmap`` runs an operator without a batching rule (``Bilinear``'s
    ``_trilinear``, ``EmbeddingBag``, ``weight_norm``) in a loop: correct, only
    slower (the module audit checks them against a per-sample autograd loop).

    Yields
    ------
    None

    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_BATCHING_LOOP, category=UserWarning)
        yield


@contextmanager
def quiet_signal_pass() -> Iterator[None]:
    """Both of the above, for the engine's signal pass, in one ``catch_warnings``.

    Each ``catch_warnings`` copies the filter list and each filter resets the
    warning caches: at Bayesian-optimisation sizes one costs as much as a small
    matrix product, and the signal pass runs once per batch.

    Yields
    ------
    None

    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_INPUT_GRAD)
        warnings.filterwarnings("ignore", message=_BATCHING_LOOP, category=UserWarning)
        yield
