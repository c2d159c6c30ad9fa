"""One pass of :class:`ContextPosterior` over its training data, batch by batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from ..backends import JacobianBackend
from ._data import Data, collect
from ._distributed import is_distributed
from ._hyperparameters import PriorGroups
from ._reduce import check_shard
from ._state import Accumulators
from ._training_data import check_inputs, xy_batches

if TYPE_CHECKING:
    from ._posterior import ContextPosterior

__all__ = ["accumulate", "check_data", "model_jacobians"]


def check_data(
    data: Data, name: str, dtype: torch.dtype, feature_shape: torch.Size
) -> None:
    """Checks before any work: a tensor's inputs, a loader's sharding.

    Parameters
    ----------
    data : DataLoader, torch.Tensor or tuple
        Training data (this rank's shard under ``torch.distributed``, which
        may be empty there).
    name : str
        The argument's name, for messages.
    dtype : torch.dtype
        The model's dtype.
    feature_shape : torch.Size
        The locations' ``input_shape``.

    Raises
    ------
    InvalidInputError
        As :func:`~laplace_diffjac.context._training_data.check_inputs` and
        :func:`~laplace_diffjac.context._reduce.check_shard`.

    """
    check_shard(data, name)
    if not isinstance(data, DataLoader):  # all inputs at once, up front
        x, _ = collect(data)
        check_inputs(x, name, dtype, feature_shape, allow_empty=is_distributed())


def model_jacobians(
    backend: JacobianBackend, x: torch.Tensor, enable_backprop: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Jacobians ``(b, C, P)`` and outputs ``(b, C)`` (last-layer aware)."""
    if getattr(backend, "last_layer", False):
        return backend.last_layer_jacobians(x, enable_backprop=enable_backprop)
    return backend.jacobians(x, enable_backprop=enable_backprop)


def accumulate(
    la: ContextPosterior,
    acc: Accumulators,
    groups: PriorGroups,
    data: Data,
    progress_bar: bool,
) -> None:
    """Add this process's data to ``acc``, one batch of inputs/Jacobians at a time.

    Parameters
    ----------
    la : ContextPosterior
        The posterior (its backend, dtype, device, locations, batch size).
    acc : Accumulators
        Sums to add to (not reduced over ranks here).
    groups : PriorGroups
        The prior groups of ``acc``.
    data : DataLoader, torch.Tensor or tuple
        The data; a loader (also over an ``IterableDataset``) is iterated once.
    progress_bar : bool
        Show a tqdm progress bar.

    """
    feature_shape = la.locations.shape[1:]
    for xb, yb in tqdm(xy_batches(data, la.batch_size), disable=not progress_bar):
        check_inputs(xb, "train_loader", la._dtype, feature_shape)
        with torch.no_grad():
            Js, f = model_jacobians(la.backend, xb.to(la._device), False)
        acc.add(Js, f, yb, groups, la.likelihood)
        del Js, f
