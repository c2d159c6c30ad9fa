"""Nyström-gap objective and location optimiser against float64 references."""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.context import (
    initial_locations,
    kmeans,
    nystrom_gap,
    optimize_locations,
    random_subset,
)
from laplace_diffjac.context.locations._routes import FactorRoute, make_route
from laplace_diffjac.kernels._likelihood_hessians import output_hessians
from tests.conftest import CASES
from tests.references import reference_jacobians

MLP = CASES[1]  # mlp-C3


def _reference_gap(model, x, z, lam, prec, jitter):
    Jx, _ = reference_jacobians(model, x)
    Jz, _ = reference_jacobians(model, z)
    M, C, _ = Jz.shape
    Kzz = torch.einsum("acp,bep->acbe", Jz, Jz).reshape(M * C, M * C) / prec
    # The relative jitter is part of the objective (not detached).
    Kzz = Kzz + jitter * Kzz.diagonal().mean() * torch.eye(M * C).double()
    Kzx = torch.einsum("acp,bep->acbe", Jz, Jx).reshape(M * C, -1) / prec
    Q = (Kzx.T @ torch.linalg.solve(Kzz, Kzx)).reshape(len(x), C, len(x), C)
    Q = torch.einsum("acae->ace", Q)
    Knn = torch.einsum("bcp,bep->bce", Jx, Jx) / prec
    return torch.einsum("bce,bce->", lam, Knn - Q)


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_gap_and_gradient_match_reference(backend_cls, likelihood):
    model = MLP.model()
    x = MLP.inputs(7, seed=1)
    z = MLP.inputs(3, seed=2).requires_grad_()
    lam = output_hessians(model(x).detach(), likelihood, sigma_noise=0.5)
    backend = backend_cls(model, likelihood)
    gap = nystrom_gap(backend, x, z, lam, 2.0, n_data=21, jitter=1e-6, chunk_size=3)
    (g,) = torch.autograd.grad(gap, z)
    ref = 3 * _reference_gap(model, x, z, lam, 2.0, 1e-6)
    (g_ref,) = torch.autograd.grad(ref, z)
    torch.testing.assert_close(gap, ref, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-8)


def test_gap_is_zero_when_locations_are_the_data():
    model = MLP.model()
    x = MLP.inputs(4)
    lam = output_hessians(model(x).detach(), "classification")
    gap = nystrom_gap(DiffBackPackGGN(model, "classification"), x, x, lam, jitter=0)
    assert abs(float(gap.detach())) < 1e-8


def test_output_hessians():
    f = torch.randn(5, 3, dtype=torch.float64)
    lam = output_hessians(f, "classification", temperature=2.0)
    p = f.softmax(-1)
    hess = torch.func.vmap(torch.func.hessian(lambda f: torch.logsumexp(f, 0)))(f)
    torch.testing.assert_close(lam, hess / 2)
    torch.testing.assert_close(p.sum(), torch.tensor(5.0, dtype=torch.float64))
    reg = output_hessians(f, "regression", sigma_noise=0.5)
    torch.testing.assert_close(reg, 4 * torch.eye(3).double().expand(5, 3, 3))
    with pytest.raises(ValueError):
        output_hessians(f, "poisson")


def test_initialisations():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(50, 2) - 5, torch.randn(50, 2) + 5])
    sub = random_subset(x, 6, gen)
    assert all((x == row).all(1).any() for row in sub)
    centres = kmeans(x, 2, gen)
    assert sorted(centres[:, 0].round().tolist()) == [-5.0, 5.0]
    given = torch.zeros(3, 2)
    assert torch.equal(initial_locations(x, 3, given), given)
    with pytest.raises(ValueError):
        initial_locations(x, 3, torch.zeros(2, 2))
    with pytest.raises(ValueError):
        random_subset(x, 101)


def test_optimiser_decreases_objective_and_records_history():
    model = MLP.model()
    x = MLP.inputs(60, seed=3)
    y = torch.zeros(60, 3, dtype=torch.float64)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True
    )
    result = optimize_locations(
        model,
        "regression",
        loader,
        4,
        init="random",
        steps=40,
        batch_size=20,
        progress_bar=False,
        seed=1,
        evaluate_full=True,
    )
    h = result.history
    assert result.locations.shape == (4, 3)
    assert len(h.objective) == len(h.time) <= 40
    assert h.time == sorted(h.time)
    assert h.final_objective < h.initial_objective
    # minibatch estimates are unbiased: their mean over a pass is near the full gap
    assert h.objective[0] == pytest.approx(h.initial_objective, rel=0.5)


def test_early_stopping_triggers():
    model = MLP.model()
    x = MLP.inputs(30, seed=3)
    result = optimize_locations(
        model,
        "regression",
        x,
        2,
        steps=500,
        patience=5,
        rel_tol=0.5,
        lr=1e-6,
        progress_bar=False,
    )
    assert result.history.stopped_early
    assert len(result.history.objective) < 500


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_cached_training_jacobians_change_nothing(likelihood):
    """J(x) cached once or recomputed every step: the same run, step for step."""
    model = MLP.model()
    x = MLP.inputs(40, seed=3)
    runs = [
        optimize_locations(
            model,
            likelihood,
            x,
            3,
            init="random",
            steps=8,
            batch_size=16,
            patience=0,
            progress_bar=False,
            cache_jacobians=cache,
            evaluate_full=True,
        )
        for cache in (False, True)
    ]
    torch.testing.assert_close(runs[0].locations, runs[1].locations)
    assert runs[0].history.objective == pytest.approx(runs[1].history.objective)
    assert runs[0].history.final_objective == pytest.approx(
        runs[1].history.final_objective
    )


class _ResidualNet(torch.nn.Module):
    """A class model (no chain route): the optimiser takes the factor route."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(3, 6)
        self.block = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + torch.tanh(self.block(h)))


@pytest.mark.parametrize("cache", [False, True])
def test_factor_route_runs_as_the_jacobian_route(cache):
    """Per-layer factors (cached or not) and Jacobians: the same run to 1e-8."""
    model = _ResidualNet().double()
    x = MLP.inputs(40, seed=3)
    route = make_route(DiffBackPackGGN(model, "classification"), 1.0, None, x.device)
    assert isinstance(route, FactorRoute)
    runs = [
        optimize_locations(
            model,
            "classification",
            x,
            3,
            init="random",
            steps=8,
            batch_size=16,
            patience=0,
            progress_bar=False,
            cache_jacobians=cache,
            evaluate_full=True,
            structured=structured,
        )
        for structured in (None, False)
    ]
    torch.testing.assert_close(
        runs[0].locations, runs[1].locations, rtol=1e-8, atol=1e-8
    )
    assert runs[0].history.objective == pytest.approx(
        runs[1].history.objective, rel=1e-8
    )
