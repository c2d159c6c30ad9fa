"""laplace-torch's ``FunctionalLaplace.fit`` over the shards of a process group.

``FunctionalLaplace`` (and ``FunctionalLLLaplace``) build the GP on a subset of
``n_subset`` training points: ``SoDSampler(N, n_subset, seed)`` draws their
indices into ``train_loader.dataset``, which is seeded and so the same draw on
every rank. Under a group, the indices run over the shards in rank order; each
rank contributes the drawn points it holds, the ``n_subset`` points are gathered
on every rank (one ``all_gather_object``; the data set itself never moves), and
laplace-torch's own ``fit`` runs on a data set of length ``N`` that holds exactly
those points. Every rank then builds the same GP as one process on all data.

Shards are indexed as laplace-torch indexes the data set: ``loader.dataset[i]``,
or, with a ``DistributedSampler``, the sampler's ``i``-th index.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from laplace.utils import SoDSampler
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import default_collate
from torch.utils.data.distributed import DistributedSampler

from ..data import all_gather_object, is_multi_process, rank
from ._shards import shard

__all__ = ["GatheredSubset", "functional_entry"]


class GatheredSubset:
    """A data set of length ``N`` holding only the GP subset's points.

    Parameters
    ----------
    n_data : int
        The global ``N`` (``len`` of this data set).
    points : dict
        Global index -> data point (as ``dataset[i]`` returns it).

    """

    def __init__(self, n_data: int, points: dict[int, Any]) -> None:
        self.n_data = n_data
        self.points = points

    def __len__(self) -> int:
        return self.n_data

    def __getitem__(self, index: Any) -> Any:
        key = int(index)
        if key not in self.points:
            raise IndexError(
                f"point {key} is not in the GP subset gathered from the ranks; "
                "only the subset drawn by SoDSampler is available after a "
                "distributed fit."
            )
        return self.points[key]


class SubsetLoader:
    """What laplace-torch's functional ``fit`` reads of the training loader."""

    def __init__(self, dataset: GatheredSubset, batch_size: int | None, probe: Any):
        self.dataset = dataset
        self.batch_size = batch_size
        self.probe = probe

    def __iter__(self) -> Iterator[Any]:
        """Only the probe (one point), for ``next(iter(loader))``.

        Returns
        -------
        iterator
        """
        return iter([self.probe])


def _local_point(loader: DataLoader, local_index: int) -> Any:
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        local_index = list(sampler)[local_index]
    return loader.dataset[local_index]


def gathered_subset(la: Any, loader: DataLoader) -> SubsetLoader:
    """The GP subset of the union of the shards, on every rank (collective).

    Parameters
    ----------
    la : FunctionalLaplace
        The estimator (its ``n_subset`` and ``seed`` choose the subset).
    loader : DataLoader
        This rank's shard.

    Returns
    -------
    SubsetLoader

    Raises
    ------
    ValueError
        If ``n_subset`` exceeds the points of all shards (on every rank).

    """
    sharded = shard(loader)
    n_data = len(sharded.dataset)
    if la.n_subset > n_data:
        raise ValueError(
            f"n_subset={la.n_subset} exceeds the {n_data} points of all shards."
        )
    lo = sum(sharded.sizes[: rank()])
    hi = lo + sharded.n_local
    drawn = [int(i) for i in SoDSampler(N=n_data, M=la.n_subset, seed=la.seed)]
    mine = {i: _local_point(loader, i - lo) for i in drawn if lo <= i < hi}
    points: dict[int, Any] = {}
    for part in all_gather_object(mine):
        points.update(part)
    probe = default_collate([points[drawn[0]]])
    return SubsetLoader(GatheredSubset(n_data, points), loader.batch_size, probe)


def functional_entry(original: Callable, uses_ours: Callable[[Any], bool]) -> Callable:
    """Wrap a functional estimator's ``fit`` to run on the gathered GP subset."""

    @functools.wraps(original)
    def fit(self: Any, train_loader: Any, *args: Any, **kwargs: Any) -> Any:
        if is_multi_process() and uses_ours(self):
            if not isinstance(train_loader, SubsetLoader):
                train_loader = gathered_subset(self, train_loader)
        return original(self, train_loader, *args, **kwargs)

    return fit
