"""Gradients of the GLM/GP predictive mean and variance w.r.t. test inputs.

With ``enable_backprop=True`` the predictive is differentiable in ``x``. The
reference is written here from scratch in float64: per-sample Jacobians by
``torch.func`` (``tests.references.reference_jacobians``) and the fitted posterior
covariance, held constant, give ``f(x)`` and ``J(x) Sigma J(x)^T`` (or the GP
posterior variance), differentiated by plain autograd.
"""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from tests.references import reference_jacobians

from .helpers import (
    GGN_BACKENDS,
    assert_close,
    base_model,
    fit,
    likelihoods,
    n_outputs_for,
    query_inputs,
    train_loader,
)

pytestmark = pytest.mark.filterwarnings(
    # laplace-torch 0.2.3 FunctionalLaplace warns on every prediction after fit.
    "ignore:The prior precision has.* changed since fit"
)


def _predictive(la, likelihood: str, x: torch.Tensor):
    if likelihood == "regression":
        return la(x, pred_type="glm") if hasattr(la, "H") else la(x)
    return la._glm_predictive_distribution(x)


def _weights(shape_mu: torch.Size, shape_var: torch.Size):
    gen = torch.Generator().manual_seed(11)
    w_mu = torch.randn(shape_mu, generator=gen, dtype=torch.float64)
    w_var = torch.randn(shape_var, generator=gen, dtype=torch.float64)
    return w_mu, w_var


def _assert_values_and_gradients(la, likelihood, reference) -> None:
    x = query_inputs(requires_grad=True)
    mu, var = _predictive(la, likelihood, x)
    x_ref = query_inputs(requires_grad=True)
    mu_ref, var_ref = reference(x_ref)
    assert_close(mu, mu_ref, "mean")
    assert_close(var, var_ref, "variance")
    w_mu, w_var = _weights(mu_ref.shape, var_ref.shape)
    for name, out, out_ref in (("mean", mu, mu_ref), ("variance", var, var_ref)):
        w = w_mu if name == "mean" else w_var
        (g,) = torch.autograd.grad((w * out).sum(), x, retain_graph=True)
        (g_ref,) = torch.autograd.grad((w * out_ref).sum(), x_ref, retain_graph=True)
        assert g.abs().sum() > 0, name
        assert_close(g, g_ref, f"d {name} / dx")


def _parametric_reference(model, sigma: torch.Tensor, params=None):
    sigma = sigma.detach()

    def reference(x):
        Js, f = reference_jacobians(model, x, params)
        return f, torch.einsum("ncp,pq,ndq->ncd", Js, sigma, Js)

    return reference


def _covariance(la, structure: str) -> torch.Tensor:
    if structure == "full":
        return la.posterior_covariance
    if structure == "diag":
        return torch.diag(la.posterior_variance)
    return torch.linalg.inv(la.posterior_precision.to_matrix())


@pytest.mark.parametrize(
    ("backend", "structure"),
    [
        (DiffBackPackGGN, "full"),
        (DiffBackPackEF, "full"),
        (DiffFuncGGN, "full"),
        (DiffBackPackGGN, "diag"),
        (DiffBackPackEF, "diag"),
        (DiffFuncGGN, "diag"),
        (DiffBackPackGGN, "kron"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
@likelihoods
def test_all_weights(backend, structure, likelihood):
    model = base_model(n_outputs_for(likelihood))
    la = fit(backend, likelihood, "all", structure, model=model, enable_backprop=True)
    reference = _parametric_reference(model, _covariance(la, structure))
    _assert_values_and_gradients(la, likelihood, reference)


@pytest.mark.parametrize(
    ("backend", "structure"),
    [
        (DiffBackPackGGN, "full"),
        (DiffFuncGGN, "full"),
        (DiffBackPackGGN, "diag"),
        (DiffBackPackGGN, "kron"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
@likelihoods
def test_last_layer(backend, structure, likelihood):
    model = base_model(n_outputs_for(likelihood))
    la = fit(
        backend, likelihood, "last_layer", structure, model=model, enable_backprop=True
    )
    last = list(model[-1].parameters())
    reference = _parametric_reference(model, _covariance(la, structure), last)
    _assert_values_and_gradients(la, likelihood, reference)


def _gp_reference(model, X_train: torch.Tensor, prior_precision: float, noise: float):
    J_train, _ = reference_jacobians(model, X_train)
    J_train = J_train.flatten(0, 1).detach()  # (N * C, P)
    gram = J_train @ J_train.T / prior_precision
    noisy = gram + noise**2 * torch.eye(len(gram), dtype=gram.dtype)

    def reference(x):
        Js, f = reference_jacobians(model, x)
        n, c, _ = Js.shape
        K_star = torch.einsum("ncp,ndp->ncd", Js, Js) / prior_precision
        K_cross = Js.flatten(0, 1) @ J_train.T / prior_precision  # (n * C, N * C)
        reduction = K_cross @ torch.linalg.solve(noisy, K_cross.T)
        blocks = reduction.reshape(n, c, n, c).diagonal(dim1=0, dim2=2)  # (c, c, n)
        return f, K_star - blocks.permute(2, 0, 1)

    return reference


def _fit_gp(backend, n_outputs: int):
    model = base_model(n_outputs)
    loader = train_loader("regression", n_outputs=n_outputs)
    X_train = loader.dataset.tensors[0]
    la = fit(
        backend,
        "regression",
        "all",
        "gp",
        model=model,
        loader=loader,
        n_subset=len(X_train),
        prior_precision=2.0,
        sigma_noise=0.5,
        enable_backprop=True,
    )
    return la, _gp_reference(model, X_train, 2.0, 0.5)


@pytest.mark.parametrize("backend", GGN_BACKENDS, ids=lambda b: b.__name__)
def test_functional_laplace_regression(backend):
    """FunctionalLaplace on all training points is the exact GP posterior."""
    la, reference = _fit_gp(backend, n_outputs=1)
    _assert_values_and_gradients(la, "regression", reference)


@pytest.mark.xfail(
    strict=True,
    reason="laplace-torch bug, not ours: FunctionalLaplace._build_K_star_M reshapes "
    "K_{M*} of layout (test, train, C_test, C_train) to (test, train*C, C) without "
    "moving C_train next to train, so for C > 1 outputs with independent_outputs="
    "False the GP variance is wrong (same with laplace-torch's BackPackGGN).",
)
def test_functional_laplace_multi_output_is_exact_gp():
    la, reference = _fit_gp(DiffFuncGGN, n_outputs=2)
    x = query_inputs()
    assert_close(la(x)[1], reference(x)[1], "variance")
