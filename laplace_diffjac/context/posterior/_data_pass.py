"""One pass over the training data, adding each batch's sums to the statistics."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..._progress import progress
from ...backends import BackendSpec, JacobianBackend
from ...data import TrainingData, check_targets
from ._features import batch_features
from ._hyperparameters import PriorGroups
from ._statistics import Accumulators

__all__ = ["accumulate", "compute_copy", "model_jacobians", "sync_copy"]


def model_jacobians(
    backend: JacobianBackend, x: torch.Tensor, enable_backprop: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Jacobians ``(b, C, P)`` and outputs ``(b, C)`` (last-layer aware)."""
    if getattr(backend, "last_layer", False):
        return backend.last_layer_jacobians(x, enable_backprop=enable_backprop)
    return backend.jacobians(x, enable_backprop=enable_backprop)


def accumulate(
    backend: JacobianBackend,
    likelihood: str,
    acc: Accumulators,
    groups: PriorGroups,
    data: TrainingData,
    feature_shape: torch.Size,
    input_dtype: torch.dtype,
    progress_bar: bool,
    offset: torch.Tensor | None = None,
    structured: bool = True,
    chunk: int | None = None,
) -> None:
    """Add this process's data to ``acc``, one batch of inputs and features at a time.

    The features are per-layer factors where the backend has them, else the
    Jacobians (:func:`._features.batch_features`).

    Parameters
    ----------
    backend : JacobianBackend
        The Jacobian backend (its model fixes dtype and device).
    likelihood : {'regression', 'classification'}
        The likelihood.
    acc : Accumulators
        Sums to add to (not reduced over ranks here).
    groups : PriorGroups
        The prior groups of ``acc``.
    data : TrainingData
        The data; a loader (also over an ``IterableDataset``) is iterated once.
    feature_shape : torch.Size
        The locations' ``input_shape``, which every batch must have.
    input_dtype : torch.dtype
        The dtype every batch must have (the user's model's); batches are cast
        to the backend's model's dtype and device for the Jacobians.
    progress_bar : bool
        Show a tqdm progress bar.
    offset : torch.Tensor, optional
        ``(P,)`` ``θ* − μ₀`` for the dual mean's sums.
    structured : bool, default=True
        Use the backend's per-layer factors where it has them.
    chunk : int, optional
        At most this many inputs at once (the memory budget's chunks): a larger
        batch is added in consecutive pieces, which changes only the order of
        the sums' additions.

    """
    param = next(iter(backend.model.parameters()))
    batches = data.checked_batches(input_dtype, feature_shape)
    for xb, yb in progress(batches, desc="Data", enabled=progress_bar):
        xb = xb.to(device=param.device, dtype=param.dtype)
        step = len(xb) if chunk is None else max(1, chunk)
        for start in range(0, len(xb), step):
            where = slice(start, start + step)
            y = None if yb is None else yb[where]
            with torch.no_grad():
                features = batch_features(backend, xb[where], False, structured)
                if y is not None:
                    check_targets(y, features.f, likelihood, f"{data.name}'s targets")
                acc.add(features, y, groups, likelihood, offset)
            del features


def compute_copy(
    model: nn.Module, backend: BackendSpec, compute_dtype: torch.dtype | None
) -> nn.Module:
    """The model the Jacobians are computed on: a ``compute_dtype`` copy, or it.

    A copy is made when the model's floating dtype differs from ``compute_dtype``
    and the backend is built here (a class or ``None``); a backend instance keeps
    its own model.

    Returns
    -------
    torch.nn.Module
        ``model`` or its copy.
    """
    dtype = next(iter(model.parameters())).dtype
    if (
        compute_dtype is None
        or dtype == compute_dtype
        or not dtype.is_floating_point
        or not (backend is None or isinstance(backend, type))
    ):
        return model
    return copy.deepcopy(model).to(compute_dtype)


def sync_copy(copy_: nn.Module, model: nn.Module) -> None:
    """Copy ``model``'s parameters and buffers into its copy (no-op if the same)."""
    if copy_ is model:
        return
    with torch.no_grad():
        for mine, theirs in zip(
            copy_.state_dict().values(), model.state_dict().values()
        ):
            mine.copy_(theirs)
