"""The context posterior's evidence against laplace-torch's FullLaplace, dense maths."""

from __future__ import annotations

import pytest
import torch
from laplace import FullLaplace

from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.context import ContextPosterior
from tests.context.helpers import MLP, dense_bound, evidence_data


def _full(model, likelihood, loader):
    la = FullLaplace(model, likelihood, backend=DiffBackPackGGN)
    la.fit(loader)
    return la


CASES_HYPER = [
    ("regression", 0.3, 0.5),
    ("regression", 2.0, 1.3),
    ("regression", 40.0, 0.1),
    ("classification", 0.3, None),
    ("classification", 5.0, None),
]


@pytest.mark.parametrize(("likelihood", "prec", "sigma"), CASES_HYPER)
def test_equals_full_laplace_evidence_when_locations_are_the_data(
    likelihood, prec, sigma
):
    model, x, _, loader = evidence_data(
        likelihood
    )  # N C = 24 <= P = 77: K_XX invertible
    full = _full(model, likelihood, loader)
    cp = ContextPosterior(model, likelihood, x, jitter=0.0).fit(loader)
    s = None if sigma is None else torch.tensor(sigma)
    expected = full.log_marginal_likelihood(torch.tensor(prec), s)
    got = cp.log_marginal_likelihood(torch.tensor(prec), s)
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=0)
    torch.testing.assert_close(
        cp.log_likelihood, full.log_likelihood, rtol=1e-10, atol=0
    )
    torch.testing.assert_close(cp.scatter, full.scatter, rtol=1e-10, atol=0)
    torch.testing.assert_close(
        cp.log_det_ratio, full.log_det_ratio, rtol=1e-8, atol=1e-10
    )


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_layerwise_and_per_parameter_prior_equal_full_laplace(likelihood):
    model, x, _, loader = evidence_data(likelihood)
    full = _full(model, likelihood, loader)
    layerwise = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.2, 7.0])
    cp = ContextPosterior(
        model, likelihood, x, prior_precision=layerwise, jitter=0.0
    ).fit(loader)
    for prec in (layerwise, torch.tensor([4.0, 1.0, 0.1, 2.0, 9.0, 0.3]), 1.7):
        p = torch.as_tensor(prec, dtype=torch.float64)
        torch.testing.assert_close(
            cp.log_marginal_likelihood(p),
            full.log_marginal_likelihood(p),
            rtol=1e-8,
            atol=0,
        )
    diag = torch.linspace(0.5, 3.0, cp.n_params, dtype=torch.float64)
    cp_diag = ContextPosterior(
        model, likelihood, x, prior_precision=diag, jitter=0.0
    ).fit(loader)
    torch.testing.assert_close(
        cp_diag.log_marginal_likelihood(),
        full.log_marginal_likelihood(diag),
        rtol=1e-8,
        atol=0,
    )
    cp_diag.prior_precision = diag * 2
    with pytest.raises(ValueError, match="fit"):
        cp_diag.log_marginal_likelihood()


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("M", [1, 3, 6])
def test_bound_matches_dense_formula_and_is_below_full_evidence(likelihood, M):
    """For random Z: equal to the dense bound, below FullLaplace's evidence."""
    model, x, y, loader = evidence_data(likelihood, n=12)  # N C = 36 <= P
    full = _full(model, likelihood, loader)
    for seed in range(3):
        z = MLP.inputs(M, 10 + seed)
        cp = ContextPosterior(model, likelihood, z, jitter=0.0).fit(loader)
        for prec, sigma in [(0.5, 0.4), (3.0, 1.0), (30.0, 2.0)]:
            s = sigma if likelihood == "regression" else 1.0
            s_arg = torch.tensor(s) if likelihood == "regression" else None
            bound = cp.log_marginal_likelihood(torch.tensor(prec), s_arg)
            dense, exact = dense_bound(model, x, y, z, likelihood, prec, s)
            torch.testing.assert_close(bound, dense, rtol=1e-7, atol=1e-10)
            evidence = full.log_marginal_likelihood(torch.tensor(prec), s_arg)
            torch.testing.assert_close(
                exact, evidence, rtol=1e-7, atol=0
            )  # reference check
            assert bound < evidence


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_gradients_match_full_laplace_and_finite_differences(likelihood):
    model, x, _, loader = evidence_data(likelihood)
    full = _full(model, likelihood, loader)
    cp = ContextPosterior(
        model, likelihood, x, prior_structure="layerwise", jitter=0.0
    ).fit(loader)
    z = MLP.inputs(3, 7)
    sparse = ContextPosterior(
        model, likelihood, z, prior_structure="layerwise", jitter=0.0
    ).fit(loader)
    reg = likelihood == "regression"
    for prec0 in (torch.tensor([1.3]), torch.tensor([0.5, 2.0, 1.0, 3.0, 0.2, 7.0])):
        grads = []
        for la in (full, cp):
            prec = prec0.double().clone().requires_grad_()
            sigma = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
            lml = la.log_marginal_likelihood(prec, sigma if reg else None)
            grads.append(torch.autograd.grad(lml, [prec, sigma] if reg else [prec]))
        for g_full, g_cp in zip(*grads):
            torch.testing.assert_close(g_cp, g_full, rtol=1e-7, atol=1e-10)

        def f(p, s):
            return sparse.log_marginal_likelihood(p, s if reg else None)

        p = prec0.double().clone().requires_grad_()
        s = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(f, (p, s) if reg else (p, torch.tensor(1.0)))
