"""Hyperparameter tuning on our backends: ``marglik_training`` and
``optimize_prior_precision`` (``marglik`` and ``gridsearch``), against upstream."""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import marglik_training

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN

from .helpers import (
    UPSTREAM,
    assert_close,
    base_model,
    fit,
    fit_pair,
    likelihoods,
    train_loader,
    upstream_quiet,
)

pytestmark = [
    # laplace-torch 0.2.3 FunctionalLaplace warns on every prediction after fit.
    pytest.mark.filterwarnings("ignore:The prior precision has.* changed since fit"),
    # laplace-torch's Kron scaling calls pow() on a tensor that requires grad
    # during marglik tuning, whatever the backend.
    pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True"),
]


def _marglik(backend, likelihood, structure):
    model = base_model(2 if likelihood == "regression" else 3)
    la, trained, margliks, losses = marglik_training(
        model,
        train_loader(likelihood),
        likelihood=likelihood,
        hessian_structure=structure,
        backend=backend,
        n_epochs=3,
        n_hypersteps=2,
        optimizer_kwargs={"lr": 1e-2},
    )
    return la, trained, margliks, losses


@pytest.mark.parametrize(
    ("backend", "structure"),
    [
        (DiffBackPackGGN, "kron"),
        (DiffBackPackGGN, "full"),
        (DiffBackPackEF, "diag"),
        (DiffFuncGGN, "diag"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
@likelihoods
def test_marglik_training_equals_upstream(backend, structure, likelihood):
    la, trained, margliks, losses = _marglik(backend, likelihood, structure)
    with upstream_quiet():
        la_u, trained_u, margliks_u, losses_u = _marglik(
            UPSTREAM[backend], likelihood, structure
        )
    assert la._backend_cls is backend
    assert_close(margliks, margliks_u, "margliks")
    assert_close(losses, losses_u, "losses")
    assert_close(la.prior_precision, la_u.prior_precision, "prior precision")
    for p, q in zip(trained.parameters(), trained_u.parameters()):
        assert_close(p, q, "trained parameters")


STRUCT = ("full", "diag")


def _tuned(la, method: str, val_loader):
    kwargs = {"n_steps": 5} if method == "marglik" else {"grid_size": 5}
    if method == "gridsearch":
        kwargs["val_loader"] = val_loader
    la.optimize_prior_precision(method=method, **kwargs)
    return la.prior_precision, la.log_marginal_likelihood()


@pytest.mark.parametrize("method", ["marglik", "gridsearch"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize(
    ("backend", "structure"),
    [(b, s) for b in (DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN) for s in STRUCT]
    + [(DiffBackPackGGN, "kron")],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_optimize_prior_precision_equals_upstream(backend, structure, subset, method):
    ours, theirs = fit_pair(backend, "regression", subset, structure)
    val = train_loader("regression", n=6, batch_size=6)
    actual = _tuned(ours, method, val)
    with upstream_quiet():
        expected = _tuned(theirs, method, val)
    assert_close(actual, expected, f"{method} tuning")


@pytest.mark.filterwarnings("ignore:Use of method='marglik' in case of Functional")
@pytest.mark.parametrize("method", ["marglik", "gridsearch"])
@pytest.mark.parametrize(
    "backend", [DiffBackPackGGN, DiffFuncGGN], ids=lambda b: b.__name__
)
def test_functional_optimize_prior_precision_equals_upstream(backend, method):
    ours, theirs = fit_pair(backend, "regression", "all", "gp", n_subset=8)
    val = train_loader("regression", n=6, batch_size=6)
    actual = _tuned(ours, method, val)
    with upstream_quiet():
        expected = _tuned(theirs, method, val)
    assert_close(actual, expected, f"{method} tuning")


def test_marglik_leaves_callers_model_untouched():
    model = base_model(2)
    before = copy.deepcopy(model.state_dict())
    fit(DiffFuncGGN, "regression", "all", "diag", model=model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
