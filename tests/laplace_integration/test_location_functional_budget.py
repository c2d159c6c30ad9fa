"""``LocationFunctionalLaplace`` within the memory budget.

Under a budget too small for the locations' (or the test inputs') factors in one
piece, fit takes the locations in chunks and keeps no factors, and predictions go
through the budgeted :func:`~laplace_diffjac.kernels.ntk`: the same float64 dense
GP of reference Jacobians, and with ``enable_backprop`` the same gradient with
respect to the test inputs as that reference's.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac.budget import memory_budget
from laplace_diffjac.errors import MemoryBudgetError
from laplace_diffjac.laplace_integration import LocationFunctionalLaplace
from tests.conftest import CASES
from tests.context.helpers import _dense_gp

# Below one piece for each case, above the budgeted ntk's smallest chunk.
BUDGETS = {CASES[1].name: "3 KiB", CASES[2].name: "10 KiB"}


def _fit(case, likelihood, budget, **kwargs):
    model = case.model()
    N, M = 24, 5
    x, z = case.inputs(N, 1), case.inputs(M, 2)
    y = model(x).detach() if likelihood == "regression" else torch.arange(N) % 3
    loader = DataLoader(TensorDataset(x, y), batch_size=6)
    la = LocationFunctionalLaplace(
        model, likelihood, z, output_hessian="full", prior_precision=2.0, **kwargs
    )
    with memory_budget(budget):
        la.fit(loader)
    return la, model, z, M / N


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=lambda c: c.name)
@pytest.mark.parametrize("joint", [False, True])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_budgeted_fit_and_predictive_give_the_dense_gp(case, likelihood, joint):
    la, model, z, weight = _fit(case, likelihood, BUDGETS[case.name])
    assert la._location_factors is None  # the budgeted fit kept no factors
    whole, *_ = _fit(case, likelihood, None)
    assert whole._location_factors is not None  # the reference fit was whole
    torch.testing.assert_close(la.K_MM, whole.K_MM, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(la.mu, whole.mu, rtol=1e-10, atol=1e-12)
    xs = case.inputs(4, 3)
    with memory_budget(BUDGETS[case.name]):
        assert not la._fits_whole(xs, len(z), False, joint)  # the budgeted path
        f_mu, f_var = la._glm_predictive_distribution(xs, joint=joint)
    ref = _dense_gp(model, z, xs, likelihood, 2.0, 1.0, weight, 1.0, True, joint)
    torch.testing.assert_close(f_var, ref, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        f = model(xs)
    torch.testing.assert_close(f_mu, f.flatten() if joint else f)
    assert not f_var.requires_grad


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=lambda c: c.name)
@pytest.mark.parametrize("joint", [False, True])
def test_budgeted_predictive_gradient_matches_the_reference(case, joint):
    """``enable_backprop``: ∂(Σ mean + Σ var)/∂x* from chunks = the reference's."""
    budget = BUDGETS[case.name]
    la, model, z, weight = _fit(case, "regression", budget, enable_backprop=True)
    xs = case.inputs(3, 3).requires_grad_()
    with memory_budget(budget):
        assert not la._fits_whole(xs, len(z), True, joint)  # the budgeted path
        f_mu, f_var = la._glm_predictive_distribution(xs, joint=joint)
    (grad,) = torch.autograd.grad(f_var.sum() + f_mu.sum(), xs)
    assert xs.grad is None
    ref_x = xs.detach().clone().requires_grad_()
    ref = _dense_gp(
        model, z, ref_x, "regression", 2.0, 1.0, weight, 1.0, True, joint, loop=True
    )
    (ref_grad,) = torch.autograd.grad(ref.sum() + model(ref_x).sum(), ref_x)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_refuses_a_budget_below_one_input():
    """A budget that cannot hold one location's factors names the setting to raise."""
    with pytest.raises(MemoryBudgetError, match="set_memory_budget"):
        _fit(CASES[2], "regression", 100)
