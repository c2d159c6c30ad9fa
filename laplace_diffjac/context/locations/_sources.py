"""The optimiser's data, in memory or streamed, read by one set-up.

:func:`read_data` makes the run's one pass over this rank's inputs
(:func:`._scan.scan`): the gathered inputs in chunks, or a loader that is never
gathered. From that pass come ``N``, the checks, the initial locations and the
default learning rate, the same way for both. Only the source of the steps'
minibatches differs (:meth:`DataReading.source`): in memory, the training side
is computed once and minibatches of global indices are served from it
(:class:`._minibatches.InMemorySource`); streamed, each step computes the
loader's next batch (:class:`._streaming.StreamSource`). The evidence objective
needs no source: it reads all data every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from ...budget import get_memory_budget
from ...data import (
    Data,
    TrainingData,
    all_reduce_sum,
    check_finite,
    check_fits_model,
    check_like_model,
    check_same_on_ranks,
    rank,
    shard_offsets,
)
from ._init import check_init_size
from ._minibatches import InMemorySource, Source
from ._routes import Route
from ._scan import (
    feature_shape,
    rank_keys,
    sampled_initial_locations,
    scan,
    shard_keys,
)
from ._settings import LocationSettings
from ._streaming import StreamSource, loader_inputs
from ._training_cache import TrainingCache, training_hessians

__all__ = ["DataReading", "read_data"]


@dataclass
class DataReading:
    """What the run's one pass found in this rank's data.

    Attributes
    ----------
    initial : torch.Tensor
        The initial locations ``(M, *input_shape)`` on the model's device,
        identical on every rank.
    lr : float
        The locations' learning rate (the setting, or the default from the data).
    n : int
        Global ``N``.
    n_local : int
        This rank's number of inputs.
    lo : int
        Global index of this rank's first input (in memory; ``0`` streamed).
    largest_batch : int
        The largest batch the pass read.
    inputs : torch.Tensor or None
        In memory: this rank's inputs ``(n_local, *input_shape)`` in the model's
        dtype; ``None`` streamed.
    loader : DataLoader or None
        Streamed: this rank's loader; ``None`` in memory.

    """

    initial: torch.Tensor
    lr: float
    n: int
    n_local: int
    lo: int
    largest_batch: int
    inputs: torch.Tensor | None
    loader: DataLoader | None

    def source(
        self, model: nn.Module, route: Route, hessian_args: tuple, s: LocationSettings
    ) -> Source:
        """The steps' minibatches: from the in-memory cache or the loader.

        Parameters
        ----------
        model : torch.nn.Module
            The network.
        route : FactorRoute or JacobianRoute
            How kernel pieces are computed.
        hessian_args : tuple
            ``(likelihood, sigma_noise, temperature, chunk_size)``.
        s : LocationSettings
            ``batch_size``, ``seed``, ``cache_jacobians``, ``chunk_size``.

        Returns
        -------
        Source

        """
        if self.loader is not None:
            return StreamSource(
                self.loader, model, route, self.n, self.n_local, hessian_args,
                self.largest_batch,
            )  # fmt: skip
        assert self.inputs is not None
        X = self.inputs
        lam = training_hessians(model, X, *hessian_args)
        budget = get_memory_budget(next(model.parameters()).device)
        cache = TrainingCache(route, X, lam, s.cache_jacobians, s.chunk_size, budget)
        return InMemorySource(cache, self.lo, self.n, s.batch_size, s.seed)


def read_data(
    model: nn.Module, data: Data, m: int, init: str | torch.Tensor, s: LocationSettings
) -> DataReading:
    """One pass over this rank's inputs: checks, ``N``, initial locations, ``lr``.

    Parameters
    ----------
    model : torch.nn.Module
        The network.
    data : DataLoader, torch.Tensor or tuple
        This rank's shard; streamed when :func:`streamed_loader` says so,
        gathered otherwise.
    m : int
        Number of locations.
    init : {'random', 'kmeans'} or torch.Tensor
        Strategy or given initial locations.
    s : LocationSettings
        ``stream``, ``chunk_size``, ``max_inputs``, ``seed``, ``lr``.

    Returns
    -------
    DataReading

    Raises
    ------
    InvalidInputError
        For non-finite inputs, an ``m`` or ``init`` that does not fit the data,
        and then (the only forward pass before the steps) inputs the model does
        not accept.

    """
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    loader = streamed_loader(data, s)
    keep = _sample_size(m, init, s.max_inputs)
    X: torch.Tensor | None = None
    if loader is None:
        X, _ = TrainingData(data, s.chunk_size, "data").gather(in_order=True)
        X = X.to(dtype)
        check_finite(X, "data")
        offsets = shard_offsets(X.shape[0], device)
        lo, n = offsets[rank()], offsets[-1]
        keys = shard_keys(s.seed, lo, n)
        found = scan(torch.split(X, s.chunk_size), model, keep, keys, device)
    else:
        batches = loader_inputs(loader, dtype)
        found = scan(batches, model, keep, rank_keys(s.seed), device)
        lo, n = 0, int(all_reduce_sum(torch.tensor([found.n], device=device)))
    shape = feature_shape(found, device)
    check_init_size(n, shape, m, init)
    if isinstance(init, torch.Tensor):
        check_like_model(init, "init", model)
        check_finite(init, "init")
        check_same_on_ranks(init, "init")
    if found.first is not None:
        check_fits_model(found.first, "data", model)
    if isinstance(init, torch.Tensor):
        Z0 = init.detach().clone()
    else:
        Z0 = sampled_initial_locations(found, shape, m, init, s.seed, device)
    lr = s.lr if s.lr is not None else found.lr
    return DataReading(
        Z0.to(device), lr, n, found.n, lo, found.largest_batch, X, loader
    )


def streamed_loader(data: Data, s: LocationSettings) -> DataLoader | None:
    """The loader if it is to be streamed (see ``LocationSettings.stream``).

    Parameters
    ----------
    data : DataLoader, torch.Tensor or tuple
        The data argument.
    s : LocationSettings
        ``stream``: ``None`` streams a loader over an ``IterableDataset``.

    Returns
    -------
    DataLoader or None
        ``None`` for data to gather.

    """
    if not isinstance(data, DataLoader):
        return None
    stream = s.stream
    if stream is None:
        stream = isinstance(data.dataset, IterableDataset)
    return data if stream else None


def _sample_size(m: int, init: str | torch.Tensor, max_inputs: int) -> int:
    """Inputs the pass samples: none for given locations, more for k-means."""
    if isinstance(init, torch.Tensor) or not isinstance(m, int):
        return 0  # an m that is not an integer is refused after the pass
    return max(m, max_inputs) if init == "kmeans" else m
