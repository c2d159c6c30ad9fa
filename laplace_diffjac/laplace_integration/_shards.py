"""Each rank's training loader as the shard of one data set.

The rule: under a process group every rank passes **its own shard** (a
``Subset``, its part of the data, or a loader with a non-padding
``DistributedSampler``); the shards in rank order form the data set, and one may
be empty. :func:`shard` reads every rank's shard size and first batch in one
collective, refuses what would count data twice or not at all, and returns a
:class:`ShardedLoader`: the local loader, with ``len(dataset)`` the global ``N``
(laplace-torch's KFAC scaling and ``n_data`` read it) and a one-sample probe on an
empty shard (laplace-torch reads ``next(iter(loader))`` for the output size and,
for last-layer Laplace, to find the last layer).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ..data import all_gather_object, broadcast_object, rank, world_size
from ..errors import InvalidInputError

__all__ = ["ShardedLoader", "shard", "shard_size"]


def shard_size(loader: DataLoader) -> int:
    """Number of data points ``loader`` holds on this rank.

    ``len(sampler)`` for a ``DistributedSampler`` (refused if it pads or was
    built for another world size), else laplace-torch's ``len(loader.dataset)``.

    Returns
    -------
    int

    Raises
    ------
    InvalidInputError
        If the sampler repeats points, or the data set has no ``len``.

    """
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        if sampler.num_replicas != world_size():
            raise InvalidInputError(
                f"the DistributedSampler was built for {sampler.num_replicas} "
                f"replicas but the process group has {world_size()} ranks."
            )
        n_dataset = len(sampler.dataset)  # type: ignore[arg-type]
        if sampler.total_size > n_dataset:
            raise InvalidInputError(
                f"the DistributedSampler pads {n_dataset} points to "
                f"{sampler.total_size} (drop_last=False), so "
                f"{sampler.total_size - n_dataset} points would be counted twice; "
                "use DistributedSampler(..., drop_last=True) or pass each rank a "
                "Subset of its own points."
            )
        return len(sampler)
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except (TypeError, AttributeError):
        raise InvalidInputError(
            "the training loader has no data set with a len() (an IterableDataset, "
            "or not a DataLoader), so this rank's number of points is unknown; pass "
            "a DataLoader over a map-style data set."
        ) from None


def _first_sample(batch: Any) -> Any:
    """The first data point of a batch, still batched (tensors sliced ``[:1]``)."""
    if isinstance(batch, torch.Tensor):
        return batch[:1].cpu()
    if isinstance(batch, Mapping):
        mapping: Any = type(batch)
        return mapping({k: _first_sample(v) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return type(batch)(_first_sample(v) for v in batch)
    return batch


def _fingerprint(batch: Any) -> tuple[float | int, ...]:
    """Sums of the first batch's tensors, to spot ranks given the same data."""
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, torch.Tensor):
        values = [values]
    tensors = [v.detach() for v in values if isinstance(v, torch.Tensor)]
    return tuple(float(v.double().sum()) for v in tensors) + tuple(
        v.numel() for v in tensors
    )


class ShardedLoader:
    """The calling rank's loader, seen by laplace-torch as one shard of the data.

    Attributes
    ----------
    local : DataLoader
        The rank's own loader; the data pass iterates it.
    sizes : list of int
        Every rank's shard size, in rank order.
    probe : object
        A one-sample batch (this rank's first, or the first non-empty rank's),
        only to read the output size and find the last layer; never counted.
    dataset : range
        ``range(N)`` with the global ``N``; a sized stand-in, never indexed.

    """

    def __init__(self, local: DataLoader, sizes: list[int], probe: Any) -> None:
        self.local = local
        self.sizes = sizes
        self.probe = probe
        self.dataset = range(sum(sizes))
        self.batch_size = local.batch_size

    @property
    def n_local(self) -> int:
        """Number of points in the calling rank's shard."""
        return self.sizes[rank()]

    def __iter__(self) -> Iterator[Any]:
        """The local batches; on an empty shard, the probe only.

        Only laplace-torch's ``next(iter(loader))`` sees the probe; the data pass
        iterates :attr:`local`.

        Returns
        -------
        iterator
        """
        return iter(self.local) if self.n_local > 0 else iter([self.probe])

    def __len__(self) -> int:
        return len(self.local)


def _local_view(loader: DataLoader) -> tuple[str | None, int, Any, tuple]:
    try:
        size = shard_size(loader)
    except InvalidInputError as error:
        return str(error), 0, None, ()
    first = next(iter(loader), None) if size > 0 else None
    if size > 0 and first is None:
        return (
            "the loader yields no batch although its shard is not empty.",
            0,
            None,
            (),
        )
    return None, size, first, () if first is None else _fingerprint(first)


def shard(loader: DataLoader) -> ShardedLoader:
    """Read every rank's shard (collective; every rank must call it).

    Parameters
    ----------
    loader : DataLoader
        This rank's training loader (its own shard; may be empty).

    Returns
    -------
    ShardedLoader

    Raises
    ------
    InvalidInputError
        On every rank alike: a rank's sampler pads, its size is unknown, all
        shards are empty, or every rank starts with the same first batch (the
        whole data set passed to each rank would be counted ``world`` times).

    """
    message, size, first, fingerprint = _local_view(loader)
    views = all_gather_object((message, size, fingerprint))
    for r, (other, _, _) in enumerate(views):
        if other is not None:
            raise InvalidInputError(f"distributed fit, rank {r}'s loader: {other}")
    sizes = [int(v[1]) for v in views]
    if sum(sizes) == 0:
        raise InvalidInputError("distributed fit: every rank's shard is empty.")
    prints = [v[2] for v in views]
    if all(s > 0 for s in sizes) and len(set(prints)) == 1 and len(set(sizes)) == 1:
        raise InvalidInputError(
            "distributed fit: every rank's loader holds the same number of points "
            "and starts with the same batch, so each rank seems to hold the whole "
            "data set, which would be counted once per rank. Pass each rank its "
            "own shard (a Subset, or a DistributedSampler(drop_last=True))."
        )
    probe = _first_sample(first) if size > 0 else None
    if 0 in sizes:
        source = next(r for r, s in enumerate(sizes) if s > 0)
        probe = broadcast_object(probe, source)
    return ShardedLoader(loader, sizes, probe)
