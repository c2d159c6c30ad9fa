"""Shards of a seeded float64 data set and rank-by-rank comparisons (1e-10)."""

from __future__ import annotations

import torch
from torch.utils.data import Subset, TensorDataset

from .helpers import n_outputs_for

N, BATCH = 120, 10
#: Shard sizes by world size (uneven; one empty with four ranks).
SHARDS = {2: [70, 50], 4: [40, 0, 50, 30]}
TOL = dict(rtol=1e-10, atol=1e-10)


def dataset(likelihood: str, n: int = N, seed: int = 3) -> TensorDataset:
    """``n`` seeded inputs ``(n, 3)`` with targets (2 outputs, or 3 classes)."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    c = n_outputs_for(likelihood)
    if likelihood == "regression":
        y = torch.randn(n, c, generator=gen, dtype=torch.float64)
    else:
        y = torch.randint(0, c, (n,), generator=gen)
    return TensorDataset(X, y)


def shard(dataset: TensorDataset, sizes: list[int], rank: int) -> Subset:
    """Rank ``rank``'s consecutive points when the shards have ``sizes``."""
    start = sum(sizes[:rank])
    return Subset(dataset, range(start, start + sizes[rank]))


def assert_equal(actual: object, expected: object, what: str) -> None:
    """Nested tensors equal to ``TOL``; everything else exactly."""
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), what  # type: ignore[arg-type]
        for a, e in zip(actual, expected):  # type: ignore[call-overload]
            assert_equal(a, e, what)
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(
            actual, expected, **TOL, msg=lambda m: f"{what}: {m}"
        )
    else:
        assert actual == expected, what


def assert_ranks_equal_reference(per_rank: list[dict], reference: dict) -> None:
    """Every rank's ``{key: {name: value}}`` equals the one-process ``reference``."""
    for rank, results in enumerate(per_rank):
        assert results.keys() == reference.keys()
        for key, expected in reference.items():
            for name, value in expected.items():
                assert_equal(results[key][name], value, f"rank {rank} {key} {name}")
