"""The collectives on real gloo process groups (2 and 4 ranks, CPU)."""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac.data import (
    all_reduce_sum,
    is_distributed,
    rank,
    shard_offsets,
    world_size,
)
from laplace_diffjac.data._ranks import run_on_ranks


def _sum_and_offsets(r: int, world: int, sizes: list[int]):
    local = torch.full((3,), float(r + 1), dtype=torch.float64)
    return {
        "distributed": is_distributed(),
        "rank": rank(),
        "world": world_size(),
        "sum": all_reduce_sum(local).clone(),
        "offsets": shard_offsets(sizes[r]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [[5, 0], [3, 7, 0, 1]])
def test_collectives_on_real_process_groups(sizes):
    world = len(sizes)
    results = run_on_ranks(_sum_and_offsets, world, sizes)
    total = world * (world + 1) / 2
    expected_offsets = [0]
    for size in sizes:
        expected_offsets.append(expected_offsets[-1] + size)
    for r, result in enumerate(results):
        assert result["distributed"] and result["rank"] == r
        assert result["world"] == world
        assert torch.equal(result["sum"], torch.full((3,), total).double())
        assert result["offsets"] == expected_offsets


def test_identity_without_a_process_group():
    assert not is_distributed() and world_size() == 1 and rank() == 0
    t = torch.arange(3.0)
    assert all_reduce_sum(t) is t and torch.equal(t, torch.arange(3.0))
    assert shard_offsets(4) == [0, 4]
