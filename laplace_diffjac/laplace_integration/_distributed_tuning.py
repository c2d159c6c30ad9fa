"""Prior-precision grid search over validation shards, and ``marglik_training``.

Under a ``torch.distributed`` group of more than one process and with this
package's backends:

* ``optimize_prior_precision(method='gridsearch', val_loader=...)`` takes each
  rank's own validation shard: for every candidate, each rank evaluates the
  validation loss on its shard and the ranks' results are averaged, weighted by
  the shard sizes, in one ``all_reduce`` for the whole grid. For a loss that is a
  mean over validation points (laplace-torch's default NLL, MSE, accuracy) that is
  the loss on the union of the shards, so every rank picks the same prior
  precision, the one a single process would pick.
* ``marglik_training`` is refused: its network steps would need the gradients
  of the global objective on every step.

Without a group, or with other backends, both are laplace-torch's own.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import laplace
import numpy as np
import torch
from laplace.baselaplace import BaseLaplace
from laplace.utils import validate

from ..data import all_gather_object, is_multi_process, rank, reduce_sum
from ..errors import InvalidInputError
from ._patching import AttributePatch
from ._shards import shard_size

__all__ = ["tuning_patches"]

#: ``uses_ours(estimator) -> bool``; ``is_ours(backend class) -> bool``.
EstimatorTest = Callable[[Any], bool]
BackendClassTest = Callable[[Any], bool]


def _validation_loss(la: Any, val_loader: Any, loss: Any, options: dict) -> float:
    try:
        return float(
            validate(la, val_loader, loss, dict_key_y=la.dict_key_y, **options)
        )
    except np.linalg.LinAlgError:
        return float("inf")
    except RuntimeError as err:
        if "not positive definite" in str(err):
            return float("inf")
        raise


def sharded_gridsearch(
    la: Any,
    loss: Any,
    interval: torch.Tensor,
    val_loader: Any,
    pred_type: Any,
    link_approx: Any = "probit",
    n_samples: int = 100,
    progress_bar: bool = False,
) -> torch.Tensor:
    """The candidate of ``interval`` with the least validation loss on all shards.

    Parameters
    ----------
    la : BaseLaplace
        The fitted estimator (its posterior is the same on every rank).
    loss, interval, val_loader, pred_type, link_approx, n_samples, progress_bar
        As laplace-torch's ``_gridsearch``; ``val_loader`` is this rank's shard
        (it may be empty).

    Returns
    -------
    torch.Tensor
        The chosen prior precision, the same on every rank.

    Raises
    ------
    InvalidInputError
        On every rank alike: every validation shard is empty, or a rank's
        shard size is unknown (a padding sampler, no ``len``).

    """
    try:
        view: tuple[int, str | None] = (shard_size(val_loader), None)
    except InvalidInputError as error:
        view = (0, str(error))
    views = all_gather_object(view)
    for r, (_, message) in enumerate(views):
        if message is not None:
            raise InvalidInputError(
                f"gridsearch, rank {r}'s validation loader: {message}"
            )
    sizes = [int(size) for size, _ in views]
    if sum(sizes) == 0:
        raise InvalidInputError("gridsearch: every rank's validation shard is empty.")
    n_local = sizes[rank()]
    options = dict(pred_type=pred_type, link_approx=link_approx, n_samples=n_samples)
    weighted = []
    for prior_prec in interval:
        la.prior_precision = prior_prec
        if n_local == 0:
            weighted.append(0.0)
            continue
        weighted.append(n_local * _validation_loss(la, val_loader, loss, options))
    totals = reduce_sum(torch.tensor(weighted, dtype=torch.float64)) / sum(sizes)
    return interval[int(np.argmin(totals.numpy()))]


def _gridsearch(original: Callable, uses_ours: EstimatorTest) -> Callable:
    @functools.wraps(original)
    def _gridsearch(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if is_multi_process() and uses_ours(self):
            return sharded_gridsearch(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return _gridsearch


def _refusing_marglik(original: Callable, is_ours: BackendClassTest) -> Callable:
    signature = inspect.signature(original)
    default = signature.parameters["backend"].default

    @functools.wraps(original)
    def marglik_training(*args: Any, **kwargs: Any) -> Any:
        backend = signature.bind(*args, **kwargs).arguments.get("backend", default)
        if is_multi_process() and is_ours(backend):
            raise NotImplementedError(
                "marglik_training with this package's backends under a "
                "torch.distributed process group is not supported: every network "
                "step would need the gradient of the global objective (all ranks' "
                "batches and the global N). Train the network with "
                "DistributedDataParallel, then fit Laplace(...) on each rank's "
                "shard and call optimize_prior_precision(method='marglik')."
            )
        return original(*args, **kwargs)

    return marglik_training


def tuning_patches(
    uses_ours: EstimatorTest, is_ours: BackendClassTest
) -> list[AttributePatch]:
    """Patches of ``BaseLaplace._gridsearch`` and ``marglik_training``.

    ``marglik_training`` is replaced where laplace-torch defines it and where it
    re-exports it (``laplace.marglik_training``); a reference taken before
    registration keeps the original.

    Parameters
    ----------
    uses_ours : callable
        ``uses_ours(estimator)``: whether its backend is one of ours.
    is_ours : callable
        ``is_ours(backend_class)``: whether the class is one of ours.

    Returns
    -------
    list of AttributePatch

    """
    patches = [
        AttributePatch(
            BaseLaplace,
            "_gridsearch",
            _gridsearch(vars(BaseLaplace)["_gridsearch"], uses_ours),
        )
    ]
    marglik_module = importlib.import_module("laplace.marglik_training")
    original = vars(marglik_module)["marglik_training"]
    wrapped = _refusing_marglik(original, is_ours)
    patches.append(AttributePatch(marglik_module, "marglik_training", wrapped))
    if vars(laplace).get("marglik_training") is original:
        patches.append(AttributePatch(laplace, "marglik_training", wrapped))
    return patches
