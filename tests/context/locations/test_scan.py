"""The run's one pass: its sample is the inputs with the smallest keys, exactly.

The reference is a direct ``topk`` over every key of the data set, drawn the way
``shard_keys`` documents (one float64 uniform per global index), independent of
the pass's buffering.
"""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac.context.locations._minibatches import stream_seed
from laplace_diffjac.context.locations._scan import scan, shard_keys

N, D = 1000, 3


def _model() -> torch.nn.Module:
    return torch.nn.Linear(D, 2).double()


def _data() -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(1)).double()


@pytest.mark.parametrize("keep", [0, 1, 50, 400, N, N + 5])
@pytest.mark.parametrize("batch", [1, 7, 256, N])
def test_the_sample_is_the_inputs_with_the_smallest_keys(keep, batch):
    x = _data()
    found = scan(torch.split(x, batch), _model(), keep, shard_keys(3, 0, N), "cpu")
    expected = torch.sort(
        torch.rand(
            N,
            generator=torch.Generator().manual_seed(stream_seed(3, 2)),
            dtype=torch.float64,
        )
    )
    take = min(keep, N)
    order = torch.argsort(found.keys)
    assert found.n == N and found.largest_batch == min(batch, N)
    assert torch.equal(found.keys[order], expected.values[:take])
    if take:
        assert torch.equal(found.rows[order], x[expected.indices[:take]])
    torch.testing.assert_close(found.first, x[:1], rtol=0, atol=0)


def test_a_shards_keys_are_the_data_sets_keys_at_its_offset():
    whole = shard_keys(5, 0, 10)(10)
    left, right = shard_keys(5, 0, 10), shard_keys(5, 4, 10)
    assert torch.equal(torch.cat([left(3), left(1), right(6)]), whole)
