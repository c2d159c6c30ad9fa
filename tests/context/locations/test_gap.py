"""The structured and the Jacobian route of the Nyström gap against each other and
against float64 ``torch.func`` references."""

from __future__ import annotations

import math

import pytest
import torch

from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.context import nystrom_gap, optimize_locations
from laplace_diffjac.kernels import output_hessians
from tests.conftest import CASES
from tests.references import reference_jacobians

MLP = CASES[1]  # mlp-C3: Linear/Tanh/Linear/Sigmoid/Linear, float64


def _gap_both_routes(likelihood, prior_precision, structured):
    model = MLP.model()
    x = MLP.inputs(9, seed=1)
    z = MLP.inputs(4, seed=2).requires_grad_()
    lam = output_hessians(model(x).detach(), likelihood, sigma_noise=0.7)
    backend = DiffBackPackGGN(model, likelihood)
    gap = nystrom_gap(
        backend,
        x,
        z,
        lam,
        prior_precision,
        n_data=27,
        chunk_size=4,
        structured=structured,
    )
    (g,) = torch.autograd.grad(gap, z)
    return gap.detach(), g


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("prior_precision", [0.3, torch.tensor(4.0)])
def test_structured_and_jacobian_objectives_agree(likelihood, prior_precision):
    """Value and gradient in Z to 1e-10 (float64), scalar prior."""
    gap_s, g_s = _gap_both_routes(likelihood, prior_precision, True)
    gap_j, g_j = _gap_both_routes(likelihood, prior_precision, False)
    torch.testing.assert_close(gap_s, gap_j, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g_s, g_j, rtol=1e-10, atol=1e-10)
    assert g_s.abs().max() > 1e-6  # a gradient that can disagree


def test_per_parameter_prior_takes_the_factor_route():
    """No chain route for a per-parameter prior: the per-layer factors, which
    agree with the Jacobians to 1e-10 (float64), value and gradient in Z."""
    model = MLP.model()
    n_params = sum(p.numel() for p in model.parameters())
    prec = torch.linspace(0.5, 2.0, n_params, dtype=torch.float64)
    auto = _gap_both_routes("classification", prec, None)
    factors = _gap_both_routes("classification", prec, True)
    jac = _gap_both_routes("classification", prec, False)
    for route in (auto, factors):
        torch.testing.assert_close(route[0], jac[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(route[1], jac[1], rtol=1e-10, atol=1e-12)


def _reference_full_gap(model, x, z, lam, prec, jitter):
    Jx, _ = reference_jacobians(model, x)
    Jz, _ = reference_jacobians(model, z)
    M, C, _ = Jz.shape
    Kzz = torch.einsum("acp,bep->acbe", Jz, Jz).reshape(M * C, M * C) / prec
    Kzz = Kzz + jitter * Kzz.diagonal().mean() * torch.eye(M * C).double()
    Kzx = torch.einsum("acp,bep->acbe", Jz, Jx).reshape(M * C, -1) / prec
    Q = (Kzx.T @ torch.linalg.solve(Kzz, Kzx)).reshape(len(x), C, len(x), C)
    Knn = torch.einsum("bcp,bep->bce", Jx, Jx) / prec
    gap = torch.einsum("bce,bce->", lam, Knn - torch.einsum("acae->ace", Q))
    return float(gap.detach())


@pytest.mark.parametrize("structured", [None, False])
def test_full_objective_only_when_asked(structured):
    model = MLP.model()
    x = MLP.inputs(30, seed=3)
    z0 = MLP.inputs(3, seed=4)
    kwargs = dict(init=z0, steps=3, batch_size=8, progress_bar=False)
    off = optimize_locations(model, "classification", x, 3, **kwargs)
    assert math.isnan(off.history.initial_objective)
    assert math.isnan(off.history.final_objective)
    on = optimize_locations(
        model,
        "classification",
        x,
        3,
        evaluate_full=True,
        structured=structured,
        prior_precision=2.0,
        **kwargs,
    )
    lam = output_hessians(model(x).detach(), "classification")
    ref0 = _reference_full_gap(model, x, z0, lam, 2.0, 1e-6)
    ref1 = _reference_full_gap(model, x, on.locations, lam, 2.0, 1e-6)
    assert on.history.initial_objective == pytest.approx(ref0, rel=1e-9)
    assert on.history.final_objective == pytest.approx(ref1, rel=1e-9)


def test_structured_and_jacobian_runs_agree():
    """Whole runs: the same locations step for step on either route."""
    model = MLP.model()
    x = MLP.inputs(40, seed=5)
    runs = [
        optimize_locations(
            model,
            "regression",
            x,
            3,
            init="random",
            steps=6,
            batch_size=10,
            patience=0,
            progress_bar=False,
            structured=s,
            sigma_noise=0.5,
        )
        for s in (True, False)
    ]
    torch.testing.assert_close(
        runs[0].locations, runs[1].locations, rtol=1e-9, atol=1e-10
    )
    assert runs[0].history.objective == pytest.approx(
        runs[1].history.objective, rel=1e-9
    )
