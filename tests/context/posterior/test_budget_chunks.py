"""``ContextPosterior`` within the memory budget changes nothing but memory and time.

Under budgets small enough that ``fit`` holds the locations in blocks, or
computes them again for every chunk of data, the predictive mean and variance,
the joint predictive, the evidence and ``update`` equal the unchunked Jacobian
route (``structured=False``, no budget) to 1e-10 in float64, for a small CNN
(convolutions over positions: both of the factor Gram's routes) and an MLP, a
scalar and a layerwise prior. A budget that not even one input fits is refused
before any work, and a chunked prediction that would keep its whole graph for a
gradient is refused with the way out.
"""

from __future__ import annotations

import pytest
import torch

import laplace_diffjac
from laplace_diffjac import ContextPosterior, DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.context.posterior._chunks import ChunkedFeatures, plan_chunks
from laplace_diffjac.kernels._feature_sizes import feature_sizes
from tests.context.helpers import small_cnn, small_mlp

F64 = torch.float64


def _problem(kind: str, likelihood: str):
    gen = torch.Generator().manual_seed(3)
    model = small_cnn() if kind == "cnn" else small_mlp()
    shape = (1, 8, 8) if kind == "cnn" else (4,)
    x = torch.randn(30, *shape, generator=gen, dtype=F64)
    with torch.no_grad():
        f = model(x)
    if likelihood == "regression":
        y = f + 0.1 * torch.randn(f.shape, generator=gen, dtype=F64)
    else:
        y = f.argmax(-1)
    xs = torch.randn(11, *shape, generator=gen, dtype=F64)
    return model, x, y, x[:7].clone(), xs


def _budgets(
    model, likelihood, z, n_groups: int, backend_class=DiffBackPackGGN
) -> dict[str, int]:
    """The smallest budgets (powers of 2^(1/4)) whose plans hold / recompute."""
    backend = backend_class(model, likelihood)
    sizes = feature_sizes(backend, z, True)
    found: dict[str, int] = {}
    budget = 2.0**10
    while len(found) < 2 and budget < 2.0**34:
        try:
            plan = plan_chunks(sizes, len(z), 8, n_groups, int(budget))
        except laplace_diffjac.MemoryBudgetError:
            plan = None
        if plan is not None and not plan.whole:
            kind = "hold" if plan.hold_locations else "recompute"
            found.setdefault(kind, int(budget))
        budget *= 2**0.25
    return found


def _fit(model, likelihood, z, x, y, prior, structured=True, backend=DiffBackPackGGN):
    kwargs = dict(sigma_noise=0.3) if likelihood == "regression" else {}
    cp = ContextPosterior(
        model,
        likelihood,
        z,
        prior_precision=prior,
        backend=backend,
        batch_size=8,
        structured=structured,
        predictive_mean="dual" if likelihood == "regression" else "network",
        **kwargs,
    )
    return cp.fit((x, y))


def _outputs(cp, xs, likelihood):
    out = {"evidence": cp.log_marginal_likelihood().detach()}
    if likelihood == "regression":
        out["mean"], out["var"] = cp(xs)
    else:
        out["probs"] = cp(xs, link_approx="probit")
    mean, cov = cp.joint_predictive(xs[:10].reshape(5, 2, *xs.shape[1:]))
    out["joint_mean"], out["joint_cov"] = mean, cov
    return out


def _close(got: dict, want: dict) -> None:
    for key, value in want.items():
        scale = value.abs().max().clamp_min(1e-300)
        err = float((got[key] - value).abs().max() / scale)
        assert err < 1e-10, (key, err)


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_chunked_posterior_equals_unchunked_jacobian_route(kind, likelihood, layerwise):
    model, x, y, z, xs = _problem(kind, likelihood)
    n_layers = len(list(model.parameters()))
    prior = torch.linspace(0.5, 2.0, n_layers, dtype=F64) if layerwise else 1.0
    want = _outputs(_fit(model, likelihood, z, x, y, prior, False), xs, likelihood)
    budgets = _budgets(model, likelihood, z, n_layers if layerwise else 1)
    assert set(budgets) == {"hold", "recompute"}, budgets
    for kind_of_plan, budget in budgets.items():
        with laplace_diffjac.memory_budget(budget):
            cp = _fit(model, likelihood, z, x, y, prior)
            assert cp._chunks is not None and not cp._chunks.whole
            assert cp._chunks.hold_locations == (kind_of_plan == "hold")
            assert cp._chunks.data < 8 or cp._chunks.locations < len(z)
            if kind_of_plan == "recompute":
                assert isinstance(cp._acc.locations, ChunkedFeatures)
                assert not cp._acc.locations.held
            _close(_outputs(cp, xs, likelihood), want)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_chunked_update_equals_refit(likelihood):
    model, x, y, z, xs = _problem("cnn", likelihood)
    want = _outputs(_fit(model, likelihood, z, x, y, 1.0, False), xs, likelihood)
    budget = _budgets(model, likelihood, z, 1)["recompute"]
    with laplace_diffjac.memory_budget(budget):
        cp = _fit(model, likelihood, z, x[:20], y[:20], 1.0)
        cp.update(x[20:], y[20:])
        _close(_outputs(cp, xs, likelihood), want)


def test_jacobian_backend_chunks_too():
    model, x, y, z, xs = _problem("mlp", "regression")
    want = _outputs(_fit(model, "regression", z, x, y, 1.0, False), xs, "regression")
    budgets = _budgets(model, "regression", z, 1, DiffFuncGGN)
    assert budgets
    for budget in budgets.values():
        with laplace_diffjac.memory_budget(budget):
            cp = _fit(model, "regression", z, x, y, 1.0, backend=DiffFuncGGN)
            assert not cp._chunks.whole
            _close(_outputs(cp, xs, "regression"), want)


def test_a_budget_nothing_fits_is_refused_before_work():
    model, x, y, z, _ = _problem("cnn", "classification")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cp = ContextPosterior(model, "classification", z)
    with laplace_diffjac.memory_budget("1 KiB"):
        with pytest.raises(laplace_diffjac.MemoryBudgetError, match="memory budget"):
            cp.fit((x, y))
    assert cp.n_data == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_a_chunked_prediction_with_its_graph_is_refused_not_chunked():
    model, x, y, z, xs = _problem("cnn", "regression")
    budget = _budgets(model, "regression", z, 1)["recompute"]
    xs = xs.clone().requires_grad_()
    with laplace_diffjac.memory_budget(budget):
        cp = _fit(model, "regression", z, x, y, 1.0)
        cp.enable_backprop = True
        with pytest.raises(laplace_diffjac.MemoryBudgetError, match="no_grad"):
            cp(xs)
        with torch.no_grad():
            mean, var = cp(xs)
    assert mean.shape == (len(xs), 3) and var.shape == (len(xs), 3, 3)
