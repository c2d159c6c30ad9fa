"""Hyperparameters changed after fit: every prediction route equals a fresh fit."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import ContextPosterior, LocationFunctionalLaplace
from tests.conftest import CASES
from tests.references import reference_jacobians

MLP = CASES[1]

BEFORE = {"prior_precision": 1.0, "sigma_noise": 0.5, "temperature": 1.0}
CHANGES = [
    ("prior_precision", 7.0),
    ("prior_precision", torch.tensor(0.2, dtype=torch.float64)),
    ("sigma_noise", 0.2),
    ("temperature", 3.0),
]


def _routes(la, likelihood, xs):
    Js, _ = reference_jacobians(la.model, xs)
    out = {
        "functional_variance": la.functional_variance(Js),
        "functional_covariance": la.functional_covariance(Js),
    }
    pred = "glm" if isinstance(la, ContextPosterior) else "gp"
    if likelihood == "regression":
        out["call"] = la(xs, pred_type=pred)
        out["call joint"] = la(xs, pred_type=pred, joint=True)
        out["call diag"] = la(xs, pred_type=pred, diagonal_output=True)
    else:
        for link in ("probit", "bridge", "bridge_norm"):
            out[link] = la(xs, pred_type=pred, link_approx=link)
        gen = torch.Generator().manual_seed(3)
        torch.manual_seed(3)  # laplace-torch 0.2.3 ignores the generator for 'mc'
        out["mc"] = la(xs, pred_type=pred, link_approx="mc", generator=gen)
    gen = torch.Generator().manual_seed(4)
    out["samples"] = la.predictive_samples(
        xs, pred_type=pred, n_samples=5, generator=gen
    )
    return out


def _build(cls, likelihood, hyper, x, z):
    model = MLP.model()
    if likelihood == "classification":
        hyper = {**hyper, "sigma_noise": 1.0}
    if cls is ContextPosterior:
        return ContextPosterior(model, likelihood, z, **hyper).fit(x)
    la = LocationFunctionalLaplace(model, likelihood, z, **hyper)
    la.fit(DataLoader(TensorDataset(x, x[:, :3]), batch_size=5))
    return la


@pytest.mark.parametrize("cls", [ContextPosterior, LocationFunctionalLaplace])
@pytest.mark.parametrize(
    ("likelihood", "name", "value"),
    [("regression", *c) for c in CHANGES]
    + [("classification", *c) for c in CHANGES if c[0] != "sigma_noise"],
)
def test_change_after_fit_equals_fresh_fit(cls, likelihood, name, value):
    x, z, xs = MLP.inputs(15, 1), MLP.inputs(4, 2), MLP.inputs(3, 3)
    la = _build(cls, likelihood, BEFORE, x, z)
    _routes(la, likelihood, xs)  # build (and cache) the factor before the change
    setattr(la, name, value)
    fresh = _build(cls, likelihood, {**BEFORE, name: value}, x, z)
    got, expected = _routes(la, likelihood, xs), _routes(fresh, likelihood, xs)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], msg=key)


def test_per_parameter_prior_change_raises_instead_of_stale_answer():
    x, z, xs = MLP.inputs(15, 1), MLP.inputs(4, 2), MLP.inputs(3, 3)
    P = sum(p.numel() for p in MLP.model().parameters())
    prec = torch.linspace(0.5, 2.0, P, dtype=torch.float64)
    la = ContextPosterior(MLP.model(), "regression", z, prior_precision=prec).fit(x)
    la.prior_precision = prec * 3
    with pytest.raises(ValueError, match=r"fit\(train_loader\) again"):
        la(xs)
    la.prior_precision = 2.0
    with pytest.raises(ValueError, match="call fit"):
        la(xs)


def test_layerwise_prior_change_needs_layerwise_structure():
    x, z, xs = MLP.inputs(15, 1), MLP.inputs(4, 2), MLP.inputs(3, 3)
    layerwise = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.float64)
    la = ContextPosterior(MLP.model(), "regression", z).fit(x)
    la.prior_precision = layerwise
    with pytest.raises(ValueError, match="prior_structure='layerwise'"):
        la(xs)
    la = ContextPosterior(
        MLP.model(), "regression", z, prior_structure="layerwise"
    ).fit(x)
    la.prior_precision = layerwise
    fresh = ContextPosterior(
        MLP.model(), "regression", z, prior_precision=layerwise
    ).fit(x)
    for a, b in zip(la(xs), fresh(xs)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("prior_precision", -1.0),
        ("prior_precision", torch.ones(5)),
        ("prior_precision", torch.ones(2, 2)),
        ("prior_precision", "1"),
        ("sigma_noise", 0.0),
        ("sigma_noise", torch.ones(2)),
    ],
)
def test_setters_validate_as_laplace_torch(name, value):
    la = ContextPosterior(MLP.model(), "regression", MLP.inputs(4, 2))
    with pytest.raises(ValueError):
        setattr(la, name, value)
