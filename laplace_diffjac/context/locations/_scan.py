"""The one pass over this rank's inputs that starts every run, in memory or streamed.

:func:`scan` reads the inputs batch by batch, whichever way they come (the
gathered tensor in chunks, or a loader that is never gathered): it counts ``N``,
accumulates their moments (the default learning rate) and keeps a bounded
random sample, from which :func:`sampled_initial_locations` draws the
initial locations. Memory holds one batch, ``O(D)`` moments and at most ``keep``
sampled inputs (times the number of ranks while the samples are merged).

The sample is the ``keep`` inputs with the smallest independent uniform keys, a
uniform random subset. In memory, an input's key depends on its global index
only (:func:`shard_keys`), so a process group draws the locations a single
process draws on the concatenated shards; streamed, each rank draws its keys
from its own stream (:func:`rank_keys`), since it cannot know its offset before
its pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ...data import all_reduce_sum, rank, world_size
from ._init import kmeans
from ._minibatches import stream_seed
from ._sharding import Moments

__all__ = [
    "KeyStream",
    "Scan",
    "feature_shape",
    "rank_keys",
    "sampled_initial_locations",
    "scan",
    "shard_keys",
]

_MAX_DIMS = 8
_F64 = torch.float64
_KEY_STREAM = 2  # stream_seed's stream of the keys (1: the minibatches' order)

#: Draws the keys of the next ``b`` inputs, ``(b,)`` float64 in ``[0, 1)``.
KeyStream = Callable[[int], torch.Tensor]


@dataclass
class Scan:
    """What one pass over this rank's inputs found.

    Attributes
    ----------
    n : int
        This rank's number of inputs.
    lr : float
        The default learning rate over all ranks
        (:meth:`._sharding.Moments.default_lr`).
    keep : int
        Sample size asked for.
    keys : torch.Tensor
        ``(min(keep, n),)`` keys of the sampled inputs, float64.
    rows : torch.Tensor
        ``(min(keep, n), *input_shape)`` the sampled inputs.
    largest_batch : int
        The largest batch read.
    first : torch.Tensor or None
        ``(1, *input_shape)`` the first input read (``None`` if none), for
        :func:`~laplace_diffjac.data.check_fits_model` after the cheaper checks.

    """

    n: int
    lr: float
    keep: int
    keys: torch.Tensor
    rows: torch.Tensor
    largest_batch: int = 0
    first: torch.Tensor | None = None


def shard_keys(seed: int, lo: int, n: int) -> KeyStream:
    """Keys of a shard's inputs by their global index (identical for any sharding).

    Parameters
    ----------
    seed : int
        The user's seed.
    lo : int
        Global index of the shard's first input.
    n : int
        Global ``N``.

    Returns
    -------
    KeyStream
        Serves the keys of the shard's inputs in order (``8 N`` bytes, drawn at
        the first call).

    """
    every: torch.Tensor | None = None
    cursor = lo

    def draw(b: int) -> torch.Tensor:
        nonlocal cursor, every
        if every is None:
            gen = torch.Generator().manual_seed(stream_seed(seed, _KEY_STREAM))
            every = torch.rand(n, generator=gen, dtype=_F64)
        cursor += b
        return every[cursor - b : cursor]

    return draw


def rank_keys(seed: int) -> KeyStream:
    """Keys from this rank's own stream of ``seed`` (a loader's unknown offset).

    Parameters
    ----------
    seed : int
        The user's seed.

    Returns
    -------
    KeyStream

    """
    gen = torch.Generator().manual_seed(stream_seed(seed, _KEY_STREAM + rank()))
    return lambda b: torch.rand(b, generator=gen, dtype=_F64)


def scan(
    batches: Iterable[torch.Tensor],
    model: nn.Module,
    keep: int,
    keys: KeyStream,
    device: torch.device,
) -> Scan:
    """Count, take the moments of and sample this rank's inputs.

    Parameters
    ----------
    batches : iterable of torch.Tensor
        This rank's inputs, ``(b, *input_shape)`` batches in the model's dtype,
        checked to be finite.
    model : torch.nn.Module
        The network (its dtype, for a rank without inputs); no forward pass.
    keep : int
        Sample size.
    keys : KeyStream
        The inputs' keys, in the order of ``batches``.
    device : torch.device
        Device the process group communicates on.

    Returns
    -------
    Scan

    """
    moments, n, largest = Moments(), 0, 0
    sample = _Sample(keep)
    first: torch.Tensor | None = None
    for xb in batches:
        if first is None and xb.shape[0]:
            first = xb[:1].detach().clone()
        n += xb.shape[0]
        largest = max(largest, int(xb.shape[0]))
        moments.add(xb)
        if keep:  # given locations: no sample, and no keys to draw
            sample.offer(keys(xb.shape[0]), xb)
    kept, rows = sample.smallest()
    if rows is None:
        rows = torch.empty(0, dtype=next(model.parameters()).dtype)
    return Scan(n, moments.default_lr(device), keep, kept, rows, largest, first)


class _Sample:
    """The ``keep`` rows of smallest key seen so far, in amortised linear time.

    Offered rows whose key is below the bound (the largest key of the last
    compaction's ``keep``) are appended; at ``2 keep`` rows the buffer is cut
    back to its ``keep`` smallest. Each row is copied a bounded number of times
    on average, where cutting back at every batch would copy ``keep`` rows per
    batch (with k-means' ``max_inputs`` rows, quadratic in ``N``). Memory: at
    most ``2 keep`` rows plus one batch's accepted rows.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.bound = math.inf if keep else -math.inf
        self.keys: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self.count = 0

    def offer(self, keys: torch.Tensor, xb: torch.Tensor) -> None:
        """Take the rows of ``xb`` ``(b, ...)`` whose ``keys`` ``(b,)`` may stay."""
        take = keys < self.bound
        if not bool(take.any()):
            return
        self.keys.append(keys[take])
        self.rows.append(xb[take.to(xb.device)].detach().clone())
        self.count += int(take.sum())
        if self.count >= 2 * self.keep:
            self._cut()

    def _cut(self) -> None:
        keys, rows = torch.cat(self.keys), torch.cat(self.rows)
        if len(keys) > self.keep:
            keys, order = torch.topk(keys, self.keep, largest=False, sorted=False)
            rows = rows[order.to(rows.device)]
        self.keys, self.rows, self.count = [keys], [rows], len(keys)
        if len(keys) == self.keep:
            self.bound = float(keys.max())

    def smallest(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(keys, rows)`` of the at most ``keep`` smallest keys (``None``: none)."""
        if not self.rows:
            return torch.empty(0, dtype=_F64), None
        self._cut()
        return self.keys[0], self.rows[0]


def sampled_initial_locations(
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
        merged sample (all inputs when ``N <= keep``).
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
    keys = torch.full((slots,), 0.0, dtype=_F64, device=device)
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
    if found.first is not None:
        shape = found.first.shape[1:]
        table[rank(), 0] = 1 + len(shape)
        table[rank(), 1 : 1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    all_reduce_sum(table)
    for row in table.tolist():
        if row[0]:
            return tuple(int(d) for d in row[1 : row[0]])
    return ()
