"""Streaming a DataLoader for the location optimiser, never gathering its inputs.

One pass (:func:`scan`) counts ``N``, accumulates the inputs' moments (the
default learning rate) and keeps a bounded random sample for the
initialisation; afterwards every step takes the loader's next batch
(:class:`StreamSource`), computing ``Λₙ`` and the kernel pieces of that batch
only. Memory holds one loader batch, ``O(D)`` moments and at most
``max(m, max_inputs)`` sampled inputs (times the number of ranks while they are
merged).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from ...budget import get_memory_budget
from ...data import (
    TrainingData,
    all_reduce_sum,
    check_finite,
    check_fits_model,
    rank,
    world_size,
)
from ._batch_pieces import RecomputedPieces
from ._budgeted_step import feature_chunk, route_sizes
from ._gap import pieces_trace
from ._init import kmeans
from ._minibatches import Batch, stream_seed
from ._routes import Route
from ._sharding import Moments
from ._training_cache import training_hessians

__all__ = [
    "Scan",
    "StreamSource",
    "feature_shape",
    "scan",
    "streamed_initial_locations",
]

_MAX_DIMS = 8


@dataclass
class Scan:
    """What one pass over this rank's loader found."""

    n: int
    lr: float
    keep: int
    keys: torch.Tensor
    rows: torch.Tensor
    largest_batch: int = 0


def loader_inputs(loader: DataLoader, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The loader's input batches in the model's dtype, checked for finiteness."""
    for xb in TrainingData(loader, name="data").input_batches():
        xb = xb.to(dtype)
        check_finite(xb, "data")
        yield xb


def scan(
    loader: DataLoader, model: nn.Module, keep: int, seed: int, device: torch.device
) -> Scan:
    """Count, moments and a bottom-``keep`` random sample of this rank's inputs.

    Every input gets an independent uniform key (this rank's own random stream
    of ``seed``); the ``keep`` smallest keys are a uniform random subset, and the
    ranks' subsets merge into the global one by their keys.

    Parameters
    ----------
    loader : DataLoader
        This rank's shard.
    model : torch.nn.Module
        The network (dtype, and a check that it accepts the inputs).
    keep : int
        Sample size.
    seed : int
        The user's seed.
    device : torch.device
        Device the process group communicates on.

    Returns
    -------
    Scan

    """
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(stream_seed(seed, 2 + rank()))
    moments, n, largest = Moments(), 0, 0
    keys = torch.empty(0, dtype=torch.float64)
    rows: torch.Tensor | None = None
    for xb in loader_inputs(loader, dtype):
        if n == 0 and xb.shape[0]:
            check_fits_model(xb, "data", model)
        n += xb.shape[0]
        largest = max(largest, int(xb.shape[0]))
        moments.add(xb)
        bk = torch.rand(xb.shape[0], generator=gen, dtype=torch.float64)
        keys = torch.cat([keys, bk])
        rows = xb.detach().clone() if rows is None else torch.cat([rows, xb.detach()])
        if keys.numel() > keep:
            keys, order = torch.topk(keys, keep, largest=False, sorted=False)
            rows = rows[order.to(rows.device)]
    if rows is None:
        rows = torch.empty(0, dtype=dtype)
    return Scan(n, moments.default_lr(device), keep, keys, rows, largest)


def streamed_initial_locations(
    found: Scan,
    feature_shape: tuple[int, ...],
    m: int,
    init: str,
    seed: int,
    device: torch.device,
) -> torch.Tensor:
    """Merge the ranks' samples; ``'random'`` or ``'kmeans'`` locations from it.

    Parameters
    ----------
    found : Scan
        This rank's pass (its sample holds at most ``keep`` inputs).
    feature_shape : tuple of int
        ``input_shape``.
    m : int
        Number of locations.
    init : {'random', 'kmeans'}
        Strategy: the ``m`` inputs with the smallest keys, or k-means on the
        merged sample.
    seed : int
        The user's seed (k-means seeding uses ``manual_seed(seed)``).
    device : torch.device
        Device of the model and the group's communication.

    Returns
    -------
    torch.Tensor
        ``(m, *input_shape)``, identical on every rank.

    """
    keep = found.keep
    slots = world_size() * keep
    keys = torch.full((slots,), 0.0, dtype=torch.float64, device=device)
    rows = torch.zeros((slots, *feature_shape), dtype=found.rows.dtype, device=device)
    mine = slice(rank() * keep, rank() * keep + keep)
    own = found.keys.numel()
    keys[mine] = 2.0  # larger than any key: an empty slot
    if own:
        keys[mine][:own] = found.keys.to(device)
        rows[mine][:own] = found.rows.to(device)
    all_reduce_sum(keys)
    all_reduce_sum(rows)
    order = torch.argsort(keys, stable=True)
    order = order[keys[order] < 2.0]
    sample = rows[order]
    if init == "random":
        return sample[:m].clone()
    return kmeans(sample, m, torch.Generator().manual_seed(seed))


class StreamSource:
    """Each step's part of the minibatch is this rank's loader's next batch.

    Parameters
    ----------
    loader : DataLoader
        This rank's shard (iterated again and again; restarted at its end).
    model : torch.nn.Module
        The network.
    route : StructuredRoute, FactorRoute or JacobianRoute
        How kernel pieces are computed.
    n : int
        Global ``N``.
    n_local : int
        This rank's count (``0``: it never contributes).
    hessian_args : tuple
        ``(likelihood, sigma_noise, temperature, chunk_size)``.
    batch_size : int, default=0
        The largest batch the loader gave in the scan: what a step is planned for.

    """

    def __init__(
        self,
        loader: DataLoader,
        model: nn.Module,
        route: Route,
        n: int,
        n_local: int,
        hessian_args: tuple,
        batch_size: int = 0,
    ) -> None:
        self.loader, self.model, self.route = loader, model, route
        self.n, self.n_local, self.args = n, n_local, hessian_args
        self.batch_size = batch_size
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.iterator: Iterator[torch.Tensor] | None = None
        self.chunk: int | None = None
        self.held_bytes = 0  # each batch's features are freed after its step

    def _batch(self, xb: torch.Tensor, hold: bool) -> Batch:
        likelihood, sigma, temperature, chunk = self.args
        xb = xb.to(self.device)
        if self.chunk is None:  # the budget's chunks, sized on the first batch
            budget = get_memory_budget(self.device)
            self.chunk = feature_chunk(route_sizes(self.route, xb), chunk, budget)
        chunk = self.chunk
        lam = training_hessians(self.model, xb, likelihood, sigma, temperature, chunk)
        recomputed = RecomputedPieces(self.route, torch.split(xb, chunk))
        held, traces = [], []
        for p, lc in zip(recomputed, torch.split(lam, chunk)):
            traces.append(pieces_trace(self.route, p, lc))
            if hold:
                held.append(p)
        return (held if hold else recomputed), lam, torch.cat(traces)

    def next_local(self, hold: bool = True) -> Batch | None:
        """Serve the loader's next non-empty batch (``None`` for an empty shard)."""
        if self.n_local == 0:
            return None
        while True:
            if self.iterator is None:
                self.iterator = loader_inputs(self.loader, self.dtype)
            xb = next(self.iterator, None)
            if xb is None:
                self.iterator = None
            elif xb.shape[0]:
                return self._batch(xb, hold)

    def full_local(self, hold: bool = True) -> Iterator[Batch]:
        """One pass over this rank's loader."""
        for xb in loader_inputs(self.loader, self.dtype):
            if xb.shape[0]:
                yield self._batch(xb, hold)


def feature_shape(found: Scan, device: torch.device) -> tuple[int, ...]:
    """``input_shape``, known on every rank (from the lowest rank with inputs).

    Parameters
    ----------
    found : Scan
        This rank's pass.
    device : torch.device
        Device the group communicates on.

    Returns
    -------
    tuple of int
        The feature shape (``()`` if no rank has inputs).

    """
    table = torch.zeros((world_size(), 1 + _MAX_DIMS), dtype=torch.int64, device=device)
    if found.n:
        shape = found.rows.shape[1:]
        table[rank(), 0] = 1 + len(shape)
        table[rank(), 1 : 1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    all_reduce_sum(table)
    for row in table.tolist():
        if row[0]:
            return tuple(int(d) for d in row[1 : row[0]])
    return ()
