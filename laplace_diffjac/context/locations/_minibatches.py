"""Where a step's minibatch comes from: the in-memory cache or a streamed loader.

A source serves this rank's part of each step's minibatch as
``(pieces, Λₙ, tr(Λₙ k(xₙ, xₙ)))`` (``None`` when the part is empty) and this
rank's part of the whole data set for a full evaluation. The optimiser sums the
parts over ranks (:func:`._sharding.sync_gradient`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from ...data import local_indices
from ._routes import Pieces
from ._training_cache import TrainingCache

__all__ = ["Batch", "InMemorySource", "Minibatches", "Source", "stream_seed"]

Batch = tuple[Sequence[Pieces], torch.Tensor, torch.Tensor]


class Source(Protocol):
    """What the optimiser asks of its data.

    ``held_bytes``: what the source keeps between steps (the cached features),
    taken from the memory budget before a step is planned; ``batch_size``: the
    largest minibatch part it serves, what a step is planned for. ``hold``: serve the
    batch's pieces computed and held (a list), or, ``False``, as
    :class:`._batch_pieces.RecomputedPieces` when the step's plan cannot hold
    them (:attr:`._budgeted_step.StepPlan.hold_batch`).
    """

    n: int
    held_bytes: int
    batch_size: int

    def next_local(self, hold: bool = True) -> Batch | None:
        """Serve this rank's part of the next minibatch (``None`` if empty)."""

    def full_local(self, hold: bool = True) -> Iterator[Batch]:
        """Serve this rank's whole shard, batch by batch."""


class InMemorySource:
    """Minibatches of global indices over the shards, served from a cache.

    The permutation stream runs over the global ``N`` exactly as in a single
    process on the concatenated data; this rank serves the indices in
    ``[offsets[rank], offsets[rank + 1])``.

    Parameters
    ----------
    cache : TrainingCache
        This rank's shard.
    lo : int
        Global index of its first input.
    n : int
        Global ``N``.
    batch_size : int
        Global minibatch size.
    seed : int
        The user's seed.

    """

    def __init__(
        self, cache: TrainingCache, lo: int, n: int, batch_size: int, seed: int
    ) -> None:
        self.cache, self.lo, self.n = cache, lo, n
        self.batch_size = batch_size
        self.batches = Minibatches(n, batch_size, seed)
        self.held_bytes = cache.held_bytes

    def next_local(self, hold: bool = True) -> Batch | None:
        """Serve this rank's part of the next global minibatch (``None`` if empty)."""
        idx = self.batches.next()
        local = local_indices(idx, self.lo, self.lo + len(self.cache))
        return self.cache.batch(local, hold) if local.numel() else None

    def full_local(self, hold: bool = True) -> Iterator[Batch]:
        """Serve this rank's shard in consecutive batches of ``batch_size``."""
        for start in range(0, len(self.cache), self.batch_size):
            yield self.cache.batch(slice(start, start + self.batch_size), hold)


def stream_seed(seed: int, stream: int) -> int:
    """A 63-bit seed for stream ``stream`` of ``seed`` (SplitMix64 finaliser).

    Stream 0 is not used: ``torch.Generator().manual_seed(seed)`` is the
    initialisation's stream, so a random subset drawn with it never shares its
    permutation with the minibatch order (stream 1).

    Parameters
    ----------
    seed : int
        The user's seed.
    stream : int
        Index of the stream, ``>= 1``.

    Returns
    -------
    int
        Seed in ``[0, 2⁶³)``.

    """
    mask = 2**64 - 1
    z = (seed + stream * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


class Minibatches:
    """Uniform minibatches without replacement within a pass (own random stream)."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.b = n, min(batch_size, n)
        self.gen = torch.Generator().manual_seed(stream_seed(seed, 1))
        self.order, self.cursor = torch.randperm(n, generator=self.gen), 0

    def next(self) -> torch.Tensor:
        """The next ``b`` global indices."""
        if self.cursor + self.b > self.n:
            self.order, self.cursor = torch.randperm(self.n, generator=self.gen), 0
        idx = self.order[self.cursor : self.cursor + self.b]
        self.cursor += self.b
        return idx


class EarlyStopping:
    """Stop after ``patience`` steps without a relative improvement of the EMA."""

    def __init__(self, patience: int, rel_tol: float) -> None:
        self.patience, self.rel_tol = patience, rel_tol
        self.best, self.since_best = math.inf, 0
        self.ema: float | None = None

    def stop(self, value: float) -> bool:
        """Feed the (all-reduced) objective of a step; whether to stop."""
        self.ema = value if self.ema is None else 0.9 * self.ema + 0.1 * value
        if math.isinf(self.best) or self.ema < self.best - self.rel_tol * abs(
            self.best
        ):
            self.best, self.since_best = self.ema, 0
        else:
            self.since_best += 1
        return bool(self.patience) and self.since_best >= self.patience
