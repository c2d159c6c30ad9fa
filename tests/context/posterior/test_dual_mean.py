"""The dual mean against a dense float64 reference, under updates, and at a MAP."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import ContextPosterior
from laplace_diffjac.context.posterior._features import JacobianBatch
from tests.references import loop_jacobians

F64 = torch.float64


def _problem(likelihood: str, n: int = 30):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, generator=gen, dtype=F64)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(F64)
    with torch.no_grad():
        f = model(x)
    if likelihood == "regression":
        y = f + 0.3 * torch.randn(f.shape, generator=gen, dtype=F64)
    else:
        y = torch.randint(0, 2, (n,), generator=gen)
    return model, x, y


def _dense_dual_mean(model, likelihood, x, y, z, xs, prec, sigma):
    """μ(x*) = f* − J* δ + K*Z (K_ZZ + K_ZX β K_XZ)⁻¹ K_ZX h (Λ̃ J_X δ + g̃)."""
    Jx, fx = loop_jacobians(model, x)
    Jz, _ = loop_jacobians(model, z)
    Js, fs = loop_jacobians(model, xs)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    N, C, P = Jx.shape
    h = 1.0 / sigma**2 if likelihood == "regression" else 1.0
    if likelihood == "regression":
        lam = torch.eye(C, dtype=F64).expand(N, C, C)
        g = y - fx
    else:
        p = fx.softmax(-1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        g = nn.functional.one_hot(y, C).to(F64) - p
    flat = lambda J: J.reshape(-1, P)  # noqa: E731
    K = lambda a, b: flat(a) @ flat(b).T / prec  # noqa: E731
    beta = torch.block_diag(*(h * lam))
    r = h * (torch.einsum("nce,ne->nc", lam, Jx @ theta) + g).reshape(-1)
    inner = K(Jz, Jz) + K(Jz, Jx) @ beta @ K(Jx, Jz)
    corr = K(Js, Jz) @ torch.linalg.solve(inner, K(Jz, Jx) @ r)
    return fs - Js @ theta + corr.reshape(fs.shape)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_dual_mean_equals_the_dense_formula(likelihood):
    model, x, y = _problem(likelihood)
    z, xs = (
        x[:5],
        torch.randn(7, 3, dtype=F64, generator=torch.Generator().manual_seed(9)),
    )
    sigma = 0.3 if likelihood == "regression" else 1.0
    cp = ContextPosterior(
        model, likelihood, z, sigma_noise=sigma, prior_precision=2.0, jitter=0.0,
        predictive_mean="dual", batch_size=7,
    ).fit((x, y))  # fmt: skip
    expected = _dense_dual_mean(model, likelihood, x, y, z, xs, 2.0, sigma)
    if likelihood == "regression":
        mean, _ = cp(xs)
    else:  # the latent mean of the predictive, from the per-layer factors
        mean, _ = cp._glm_predictive_distribution(xs)
    torch.testing.assert_close(mean, expected, rtol=1e-9, atol=1e-12)
    # and from Jacobians that the caller passes (the reference loop's)
    Js, f = loop_jacobians(model, xs)
    with_jacobians = cp._dual_mean(JacobianBatch(Js, f))
    torch.testing.assert_close(with_jacobians, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_a_dual_update_equals_a_refit(likelihood):
    model, x, y = _problem(likelihood, n=40)
    z, xs = (
        x[:6],
        torch.randn(9, 3, dtype=F64, generator=torch.Generator().manual_seed(8)),
    )
    kw = dict(predictive_mean="dual", batch_size=8)
    refit = ContextPosterior(model, likelihood, z, **kw).fit((x, y))
    updated = ContextPosterior(model, likelihood, z, **kw).fit((x[:25], y[:25]))
    updated.update(x[25:], y[25:])
    Js, f = loop_jacobians(model, xs)
    for a, b in [
        (
            updated._glm_predictive_distribution(xs)[0],
            refit._glm_predictive_distribution(xs)[0],
        ),
        (updated.functional_covariance(Js), refit.functional_covariance(Js)),
    ]:
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
    # and the update moved the mean: the first fit's dual mean is another one
    first = ContextPosterior(model, likelihood, z, **kw).fit((x[:25], y[:25]))
    moved = (
        first._glm_predictive_distribution(xs)[0]
        - refit._glm_predictive_distribution(xs)[0]
    )
    assert moved.abs().max() > 1e-3


def _linear_map(likelihood: str, prec: float, sigma: float):
    """A linear model at its exact MAP (N C <= P, so K_XX is invertible)."""
    gen = torch.Generator().manual_seed(5)
    C = 2 if likelihood == "regression" else 3
    x = torch.randn(4, 3, generator=gen, dtype=F64)
    model = nn.Linear(3, C).to(F64)
    if likelihood == "regression":
        y = torch.randn(4, C, generator=gen, dtype=F64)
    else:
        y = torch.tensor([0, 1, 2, 1])
    params = list(model.parameters())

    def objective():
        f = model(x)
        if likelihood == "regression":
            nll = 0.5 * (y - f).square().sum() / sigma**2
        else:
            nll = nn.functional.cross_entropy(f, y, reduction="sum")
        return nll + 0.5 * prec * sum(p.square().sum() for p in params)

    for _ in range(30):  # Newton's method: the MAP to rounding
        flat = torch.cat([p.reshape(-1) for p in params])
        grad = torch.autograd.grad(objective(), params, create_graph=True)
        g = torch.cat([q.reshape(-1) for q in grad])
        H = torch.stack([
            torch.cat([q.reshape(-1) for q in torch.autograd.grad(gi, params,
                                                                   retain_graph=True)])
            for gi in g
        ])  # fmt: skip
        step = torch.linalg.solve(H, g.detach())
        with torch.no_grad():
            new = flat - step
            torch.nn.utils.vector_to_parameters(new, params)
    return model, x, y


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_at_the_data_of_the_fit_the_dual_mean_is_the_network(likelihood):
    sigma = 0.5 if likelihood == "regression" else 1.0
    model, x, y = _linear_map(likelihood, prec=2.0, sigma=sigma)
    cp = ContextPosterior(
        model, likelihood, x, sigma_noise=sigma, prior_precision=2.0, jitter=0.0,
        predictive_mean="dual",
    ).fit((x, y))  # fmt: skip
    xs = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    f = model(xs).detach()
    mean, _ = cp._glm_predictive_distribution(xs)
    torch.testing.assert_close(mean, f, rtol=1e-9, atol=1e-10)


def test_the_dual_mean_needs_targets_and_the_fit_s_linearisation():
    model, x, y = _problem("regression")
    cp = ContextPosterior(model, "regression", x[:4], predictive_mean="dual")
    cp.fit(x)  # inputs only: the covariance is fine, the dual mean is not
    with pytest.raises(ValueError, match="needs the training targets"):
        cp(x[:2])
    cp.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    cp(x[:2])
    cp.prior_mean = 0.1
    with pytest.raises(ValueError, match="call fit again"):
        cp(x[:2])
    with pytest.raises(ValueError, match="predictive_mean must be"):
        ContextPosterior(model, "regression", x[:4], predictive_mean="glm")
