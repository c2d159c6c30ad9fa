"""Streaming optimize_locations: loaders (and IterableDatasets) are never gathered.

References are independent of the optimiser: Adam run by hand on the public
objective ``nystrom_gap`` over the loader's batch sequence, ``torch.std`` for the
default learning rate, and the full-data ``nystrom_gap``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.context import LocationSettings, nystrom_gap, optimize_locations
from laplace_diffjac.errors import InvalidInputError
from laplace_diffjac.kernels._likelihood_hessians import output_hessians
from tests.conftest import CASES

MLP = CASES[1]  # mlp-C3
N, M, B = 17, 3, 5


class _Batches(IterableDataset):
    """Yields fixed input batches; it cannot be indexed."""

    def __init__(self, x: torch.Tensor, batch_size: int) -> None:
        self.x, self.batch_size = x, batch_size

    def __iter__(self):
        yield from torch.split(self.x, self.batch_size)


def _loaders(x: torch.Tensor) -> dict[str, DataLoader]:
    return {
        "tensor-dataset": DataLoader(TensorDataset(x), batch_size=B, shuffle=False),
        "iterable": DataLoader(_Batches(x, B), batch_size=None),
    }


def _settings(**options) -> LocationSettings:
    return LocationSettings(progress_bar=False, **options)


@pytest.mark.parametrize("kind", ["tensor-dataset", "iterable"])
def test_streaming_equals_adam_on_the_loaders_batches(kind):
    model, x = MLP.model(), MLP.inputs(N, seed=3)
    z0, steps = MLP.inputs(M, seed=4), 6
    stream = None if kind == "iterable" else True  # an IterableDataset streams
    result = optimize_locations(
        model,
        "classification",
        _loaders(x)[kind],
        M,
        init=z0,
        settings=_settings(steps=steps, lr=0.03, stream=stream, patience=0),
    )
    backend = DiffBackPackGGN(model, "classification")
    batches = list(torch.split(x, B))  # 5, 5, 5, 2, then again from the start
    Z = z0.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([Z], lr=0.03)
    objective = []
    for t in range(steps):
        xb = batches[t % len(batches)]
        lam = output_hessians(model(xb).detach(), "classification")
        gap = nystrom_gap(backend, xb, Z, lam, n_data=N)
        (Z.grad,) = torch.autograd.grad(gap, Z)
        optimizer.step()
        objective.append(float(gap.detach()))
    torch.testing.assert_close(result.locations, Z.detach(), rtol=1e-10, atol=0)
    torch.testing.assert_close(
        torch.tensor(result.history.objective),
        torch.tensor(objective),
        rtol=1e-10,
        atol=0,
    )


def test_streamed_full_objective_and_default_lr():
    model, x = MLP.model(), MLP.inputs(N, seed=3) * torch.tensor([1.0, 3.0, 0.5])
    z0 = MLP.inputs(M, seed=4)
    loader = DataLoader(_Batches(x, B), batch_size=None)
    result = optimize_locations(
        model,
        "classification",
        loader,
        M,
        init=z0,
        settings=_settings(steps=1, evaluate_full=True),
    )
    lam = output_hessians(model(x).detach(), "classification")
    full = nystrom_gap(DiffBackPackGGN(model, "classification"), x, z0, lam)
    torch.testing.assert_close(
        torch.tensor(result.history.initial_objective, dtype=torch.float64),
        full.detach(),
        rtol=1e-10,
        atol=0,
    )
    # Adam's first step moves every coordinate by lr (up to its eps).
    lr = 0.05 * float(x.std(dim=0).mean())
    step = (result.locations - z0).abs()
    torch.testing.assert_close(step, torch.full_like(step, lr), rtol=1e-6, atol=0)


def test_streamed_initialisations_come_from_the_data():
    model = MLP.model()
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(40, 3, generator=gen) - 5, torch.randn(40, 3) + 5])
    x = x.double()[torch.randperm(80, generator=gen)]
    loader = DataLoader(_Batches(x, 7), batch_size=None)
    options = dict(steps=0, max_inputs=30)
    Z = optimize_locations(
        model, "regression", loader, 6, init="random", settings=_settings(**options)
    ).locations
    assert all((x == row).all(1).any() for row in Z)
    assert len({tuple(row.tolist()) for row in Z}) == 6
    centres = optimize_locations(
        model, "regression", loader, 2, init="kmeans", settings=_settings(**options)
    ).locations
    assert sorted(centres[:, 0].round().tolist()) == [-5.0, 5.0]


def test_streamed_m_larger_than_n_is_rejected():
    loader = DataLoader(_Batches(MLP.inputs(N), B), batch_size=None)
    with pytest.raises(InvalidInputError, match="m \\(the number of locations\\)"):
        optimize_locations(
            MLP.model(), "regression", loader, N + 1, settings=_settings(steps=1)
        )


def test_max_inputs_is_validated():
    with pytest.raises(InvalidInputError, match="max_inputs"):
        LocationSettings(max_inputs=0)
