"""One set-up for the optimiser's data: in memory is streaming with a cache.

The run's one pass (``_scan``) and its set-up (``_sources``) are shared by both
routes, so the same inputs in memory and as a loader that serves them in one
batch give the same initial locations, learning rate and steps.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from laplace_diffjac.context import optimize_locations
from laplace_diffjac.context.locations import _sources
from laplace_diffjac.errors import InvalidInputError
from tests.conftest import CASES

MLP = CASES[1]  # mlp-C3, float64
N, M = 17, 3


class _Batches(IterableDataset):
    """Yields fixed input batches; it cannot be indexed."""

    def __init__(self, x: torch.Tensor, batch_size: int) -> None:
        self.x, self.batch_size = x, batch_size

    def __iter__(self):
        yield from torch.split(self.x, self.batch_size)


class _CountingModel(torch.nn.Sequential):
    """The MLP case, counting forward calls."""

    calls = 0

    def forward(self, x):  # noqa: D102
        type(self).calls += 1
        return super().forward(x)


@pytest.mark.parametrize("init", ["random", "kmeans"])
def test_in_memory_equals_a_loader_of_one_batch(init):
    """Every minibatch is all N inputs: the two sources serve the same sums."""
    x = MLP.inputs(N, seed=3)
    loader = DataLoader(_Batches(x, N), batch_size=None)
    kw = dict(init=init, steps=4, batch_size=N, seed=6, progress_bar=False)
    kw["evaluate_full"] = True
    memory = optimize_locations(MLP.model(), "classification", x, M, **kw)
    streamed = optimize_locations(MLP.model(), "classification", loader, M, **kw)
    first = optimize_locations(
        MLP.model(), "classification", x, M, **{**kw, "steps": 0}
    )
    assert not torch.equal(first.locations, memory.locations)  # the steps moved Z
    torch.testing.assert_close(streamed.locations, memory.locations, rtol=1e-10, atol=0)
    assert streamed.history.objective == pytest.approx(memory.history.objective, 1e-10)
    assert streamed.history.initial_objective == pytest.approx(
        memory.history.initial_objective, rel=1e-10
    )


def test_the_evidence_objective_computes_no_training_cache(monkeypatch):
    """It reads all data every step; the gap's cache would be a wasted pass."""
    built = []
    cache = _sources.TrainingCache

    def spy(*args, **kwargs):
        built.append(1)
        return cache(*args, **kwargs)

    monkeypatch.setattr(_sources, "TrainingCache", spy)
    x = MLP.inputs(N, seed=3)
    y = torch.randint(0, 3, (N,))
    kw = dict(init="random", steps=1, progress_bar=False)
    optimize_locations(MLP.model(), "classification", (x, y), M, **kw)
    assert len(built) == 1
    optimize_locations(
        MLP.model(), "classification", (x, y), M, objective="evidence", **kw
    )
    assert len(built) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_an_init_that_does_not_fit_is_refused_before_any_forward_pass(stream):
    torch.manual_seed(0)
    model = _CountingModel(*MLP.make_model(3)).double().eval()
    _CountingModel.calls = 0
    x = MLP.inputs(N, seed=3)
    data = DataLoader(_Batches(x, 5), batch_size=None) if stream else x
    with pytest.raises(InvalidInputError, match="m \\(the number of locations\\)"):
        optimize_locations(model, "regression", data, N + 1, progress_bar=False)
    with pytest.raises(InvalidInputError, match="init"):
        optimize_locations(model, "regression", data, M, init=x[:2], progress_bar=False)
    assert _CountingModel.calls == 0
