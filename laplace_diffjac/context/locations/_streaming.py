"""Streaming a DataLoader for the location optimiser, never gathering its inputs.

After the run's one pass (:mod:`._scan`), every step takes the loader's next
batch (:class:`StreamSource`), computing ``Λₙ`` and the kernel pieces of that
batch only. Memory holds one loader batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from ...budget import get_memory_budget
from ...data import TrainingData, check_finite
from ._batch_pieces import RecomputedPieces
from ._budgeted_step import feature_chunk, route_sizes
from ._gap import pieces_trace
from ._minibatches import Batch
from ._routes import Route
from ._training_cache import training_hessians

__all__ = ["StreamSource", "loader_inputs"]


def loader_inputs(loader: DataLoader, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The loader's input batches in the model's dtype, checked for finiteness."""
    for xb in TrainingData(loader, name="data").input_batches():
        xb = xb.to(dtype)
        check_finite(xb, "data")
        yield xb


class StreamSource:
    """Each step's part of the minibatch is this rank's loader's next batch.

    Parameters
    ----------
    loader : DataLoader
        This rank's shard (iterated again and again; restarted at its end).
    model : torch.nn.Module
        The network.
    route : FactorRoute or JacobianRoute
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
