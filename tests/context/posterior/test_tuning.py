"""optimize_prior_precision on a ContextPosterior against FullLaplace's."""

from __future__ import annotations

import math

import pytest
import torch
from laplace import FullLaplace
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.context import ContextPosterior
from tests.conftest import CASES
from tests.context.helpers import evidence_data
from tests.docs import block, page

MLP = CASES[1]


def _pair(likelihood, **kwargs):
    model, x, _, loader = evidence_data(likelihood)
    full = FullLaplace(model, likelihood, backend=DiffBackPackGGN)
    full.fit(loader)
    cp = ContextPosterior(model, likelihood, x, jitter=0.0, **kwargs).fit(loader)
    return full, cp


def _full_optimize(full, likelihood, **kwargs):
    if likelihood == "classification":  # laplace-torch warns about link_approx
        with pytest.warns(UserWarning, match="link_approx"):
            full.optimize_prior_precision(**kwargs)
    else:
        full.optimize_prior_precision(**kwargs)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("structure", ["scalar", "layerwise"])
def test_marglik_matches_full_laplace(likelihood, structure):
    full, cp = _pair(likelihood, prior_structure=structure)
    steps = 15 if structure == "scalar" else 6
    kwargs = dict(method="marglik", n_steps=steps, lr=0.1, prior_structure=structure)
    _full_optimize(full, likelihood, pred_type="glm", **kwargs)
    cp.optimize_prior_precision("glm", **kwargs)  # laplace-torch's call, unchanged
    torch.testing.assert_close(
        cp.prior_precision, full.prior_precision, rtol=1e-6, atol=0
    )


def test_marglik_with_sigma_noise_matches_adam_on_full_laplace():
    full, cp = _pair("regression")
    log_prec = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    log_sigma = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([log_prec, log_sigma], lr=0.1)
    for _ in range(15):
        opt.zero_grad()
        (-full.log_marginal_likelihood(log_prec.exp(), log_sigma.exp())).backward()
        opt.step()
    cp.optimize_prior_precision(n_steps=15, lr=0.1, learn_sigma_noise=True)
    torch.testing.assert_close(
        cp.prior_precision, log_prec.detach().exp(), rtol=1e-6, atol=0
    )
    torch.testing.assert_close(
        cp.sigma_noise, log_sigma.detach().exp(), rtol=1e-6, atol=0
    )


def _regression_nll(mean, var, y):
    v = var.diagonal(dim1=-2, dim2=-1) + 0.25
    return (0.5 * ((y - mean) ** 2 / v + v.log() + math.log(2 * math.pi))).mean()


def _classification_nll(probs, y):
    return -probs[torch.arange(len(y)), y].log().mean()


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_gridsearch_matches_full_laplace(likelihood):
    full, cp = _pair(likelihood)
    model = cp.model
    xv = MLP.inputs(10, 9)
    with torch.no_grad():
        f = model(xv)
    if likelihood == "regression":
        yv, loss = f + 0.5 * torch.randn_like(f), _regression_nll
    else:
        yv, loss = torch.randint(0, 3, (10,)), _classification_nll
    val = DataLoader(TensorDataset(xv, yv), batch_size=4)
    kwargs = dict(method="gridsearch", val_loader=val, loss=loss, grid_size=9)
    _full_optimize(full, likelihood, pred_type="glm", **kwargs)
    cp.optimize_prior_precision(pred_type="glm", **kwargs)
    torch.testing.assert_close(
        cp.prior_precision, full.prior_precision.double().reshape(1)
    )


def test_default_running_metric_is_reset_per_grid_value():
    """Default NLL metric: each grid value is scored on its own predictions."""
    _, cp = _pair("classification")
    xv, yv = MLP.inputs(10, 9), torch.randint(0, 3, (10,))
    val = DataLoader(TensorDataset(xv, yv), batch_size=4)
    grid = torch.logspace(-2, 2, 5, dtype=torch.float64)
    nll = []
    for p in grid:
        cp.prior_precision = p
        nll.append(float(_classification_nll(cp(xv), yv)))
    cp.optimize_prior_precision(
        method="gridsearch",
        val_loader=val,
        grid_size=5,
        log_prior_prec_min=-2,
        log_prior_prec_max=2,
    )
    torch.testing.assert_close(
        cp.prior_precision, grid[[int(torch.tensor(nll).argmin())]]
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "gridsearch"}, "val_loader"),
        ({"method": "cv"}, "method"),
        ({"pred_type": "nn"}, "pred_type"),
        ({"prior_structure": "diag"}, "per-parameter"),
        ({"prior_structure": "layerwise"}, "prior_structure='layerwise'"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    _, cp = _pair("regression")
    with pytest.raises(ValueError, match=match):
        cp.optimize_prior_precision(n_steps=1, **kwargs)


def test_val_loader_with_marglik_warns_as_laplace_torch():
    _, cp = _pair("regression")
    val = DataLoader(TensorDataset(MLP.inputs(2), torch.zeros(2, 3)), batch_size=2)
    with pytest.warns(UserWarning, match="ignored"):
        cp.optimize_prior_precision(n_steps=1, val_loader=val)


@pytest.mark.slow
def test_readme_evidence_example_runs():
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 64).unsqueeze(1)
    y = torch.sin(2 * x) + 0.1 * torch.randn_like(x)
    model = torch.nn.Sequential(
        torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    namespace = {
        "model": model,
        "train_loader": loader,
        "Z": x[::8],
        "ContextPosterior": ContextPosterior,
    }
    code = compile(block("docs-evidence", page("posterior.md")), "posterior.md", "exec")
    exec(code, namespace)  # noqa: S102
    cp = namespace["cp"]
    assert float(cp.prior_precision) > 0 and 0 < float(cp.sigma_noise) < 1


def test_default_validation_losses_equal_laplace_torch_s():
    """The grid search's own losses against torchmetrics' MSE and laplace's NLL."""
    import torchmetrics
    from laplace.utils import RunningNLLMetric

    from laplace_diffjac.context.posterior._tuning import MeanSquaredError, RunningNLL

    gen = torch.Generator().manual_seed(0)
    mean, y = torch.randn(20, 3, generator=gen), torch.randn(20, 3, generator=gen)
    ours, theirs = MeanSquaredError(), torchmetrics.MeanSquaredError(num_outputs=3)
    for a, b in ((mean[:7], y[:7]), (mean[7:], y[7:])):
        ours.update(a, torch.ones_like(a), b)
        theirs.update(a, b)
    torch.testing.assert_close(ours.compute().float(), theirs.compute().float())
    probs = torch.softmax(torch.randn(20, 4, generator=gen), -1)
    labels = torch.randint(0, 4, (20,), generator=gen)
    ours_nll, theirs_nll = RunningNLL(), RunningNLLMetric()
    for sl in (slice(0, 7), slice(7, 20)):
        ours_nll.update(probs[sl], labels[sl])
        theirs_nll.update(probs[sl], labels[sl])
    torch.testing.assert_close(
        ours_nll.compute().float(), torch.as_tensor(theirs_nll.compute()).float()
    )
