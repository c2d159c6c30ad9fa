"""The context posterior on the engine's per-layer factors: dense numbers, no ``J``.

With ``DiffBackPackGGN`` the posterior computes every Gram, the GGN diagonal and
the dual mean's ``J δ`` from the per-layer factors (``_features.FactorBatch``).
For class models (residual and shared layers, a CNN, a layer norm) and scalar,
per-layer and per-parameter priors, the predictive covariances, the dual mean and
the evidence equal dense float64 formulas written with the per-sample autograd
loop's Jacobians (:func:`tests.references.loop_jacobians`); nothing ever writes
more than one parameter's Jacobian block; a state saved by the previous format
(which kept the locations' whitened Jacobians) loads to the same posterior.
"""

from __future__ import annotations

import math

import pytest
import torch

from laplace_diffjac import ContextPosterior, DiffBackPackGGN
from laplace_diffjac.context.posterior import _evidence_gradient
from tests.class_models import built
from tests.references import central_difference, loop_jacobians

F64 = torch.float64
TOL = {"rtol": 1e-8, "atol": 1e-10}
NAMES = ["residual-shared", "cnn", "layer-norm"]


def _problem(name: str, likelihood: str):
    model, x = built(name, 12, seed=1)
    _, z = built(name, 3, seed=2)
    _, xs = built(name, 4, seed=3)
    with torch.no_grad():
        f = model(x)
    gen = torch.Generator().manual_seed(4)
    if likelihood == "regression":
        y = f + 0.3 * torch.randn(f.shape, generator=gen, dtype=F64)
    else:
        y = torch.randint(0, 3, (len(x),), generator=gen)
    return model, x, y, z, xs


def _prior_precision(model, structure: str) -> float | torch.Tensor:
    params = list(model.parameters())
    if structure == "scalar":
        return 2.0
    if structure == "layerwise":
        return torch.linspace(0.5, 3.0, len(params), dtype=F64)
    P = sum(p.numel() for p in params)
    return torch.linspace(0.5, 3.0, P, dtype=F64)


def _prior_var(model, prec) -> torch.Tensor:
    sizes = [p.numel() for p in model.parameters()]
    prec = torch.as_tensor(prec, dtype=F64).reshape(-1)
    if prec.numel() == 1:
        return prec.reciprocal().expand(sum(sizes))
    if prec.numel() == len(sizes):
        return torch.repeat_interleave(prec, torch.tensor(sizes)).reciprocal()
    return prec.reciprocal()


def _lam(f: torch.Tensor, likelihood: str, sigma: float) -> torch.Tensor:
    if likelihood == "regression":
        return torch.eye(f.shape[1], dtype=F64).expand(len(f), -1, -1) / sigma**2
    p = f.softmax(-1)
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


def _dense(model, x, y, z, xs, likelihood, prec, sigma):
    """Covariance, dual mean and the scalar-prior bound, written out densely."""
    Jx, fx = loop_jacobians(model, x)
    Jz, _ = loop_jacobians(model, z)
    Js, fs = loop_jacobians(model, xs)
    Jx, Jz, Js = (J.detach().flatten(0, 1) for J in (Jx, Jz, Js))
    fx, fs = fx.detach(), fs.detach()
    var = _prior_var(model, prec)
    lam = torch.block_diag(*_lam(fx, likelihood, sigma))
    Kzz, Kzx, Kzs = (Jz * var) @ Jz.T, (Jz * var) @ Jx.T, (Jz * var) @ Js.T
    Kss = (Js * var) @ Js.T
    inner = Kzz + Kzx @ lam @ Kzx.T
    cov = Kss - Kzs.T @ (torch.linalg.inv(Kzz) - torch.linalg.inv(inner)) @ Kzs
    # the dual mean (test_dual_mean's formula): δ = θ* (prior mean 0)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if likelihood == "regression":
        grad = (y - fx) / sigma**2
    else:
        grad = torch.nn.functional.one_hot(y, 3).to(F64) - fx.softmax(-1)
    r = lam @ (Jx @ theta) + grad.reshape(-1)
    mean = fs.reshape(-1) - Js @ theta + Kzs.T @ torch.linalg.solve(inner, Kzx @ r)
    return cov, mean.reshape(fs.shape)


@pytest.mark.parametrize("structure", ["scalar", "layerwise", "diag"])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("name", NAMES)
def test_predictive_equals_the_dense_formulas(name, likelihood, structure):
    model, x, y, z, xs = _problem(name, likelihood)
    sigma = 0.3 if likelihood == "regression" else 1.0
    prec = _prior_precision(model, structure)
    cp = ContextPosterior(
        model, likelihood, z, prior_precision=prec, sigma_noise=sigma, jitter=0.0,
        prior_structure=structure, predictive_mean="dual", batch_size=5,
    ).fit((x, y))  # fmt: skip
    cov, mean = _dense(model, x, y, z, xs, likelihood, prec, sigma)
    mu, joint = cp.joint_predictive(xs)
    torch.testing.assert_close(joint, cov, **TOL)
    torch.testing.assert_close(mu, mean, **TOL)
    _, per_input = cp._glm_predictive_distribution(xs)
    blocks = torch.einsum("acae->ace", cov.reshape(4, 3, 4, 3))
    torch.testing.assert_close(per_input, blocks, **TOL)


def test_structured_false_forms_jacobians_and_gives_the_same_numbers(
    assembled_widths,
):
    model, x, y, z, xs = _problem("cnn", "classification")
    prec = _prior_precision(model, "layerwise")
    cp = ContextPosterior(
        model, "classification", z, prior_precision=prec, jitter=0.0,
        predictive_mean="dual", batch_size=5, structured=False,
    ).fit((x, y))  # fmt: skip
    cov, mean = _dense(model, x, y, z, xs, "classification", prec, 1.0)
    mu, joint = cp.joint_predictive(xs)
    torch.testing.assert_close(joint, cov, **TOL)
    torch.testing.assert_close(mu, mean, **TOL)
    assert max(assembled_widths) == len(list(model.parameters()))  # J of all


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("name", NAMES)
def test_evidence_equals_the_dense_bound(name, likelihood):
    model, x, y, z, _ = _problem(name, likelihood)
    sigma = 0.3 if likelihood == "regression" else 1.0
    cp = ContextPosterior(
        model, likelihood, z, prior_precision=2.0, sigma_noise=sigma, jitter=0.0
    ).fit((x, y))
    Jx, fx = (t.detach() for t in loop_jacobians(model, x))
    Jz, _ = (t.detach() for t in loop_jacobians(model, z))
    bound = _dense_bound(model, Jx, fx, Jz, y, likelihood, 2.0, sigma)
    torch.testing.assert_close(cp.log_marginal_likelihood(), bound, **TOL)


def _dense_bound(model, Jx, fx, Jz, y, likelihood, prec, sigma):
    """The collapsed bound (:mod:`tests.context.helpers`) from given Jacobians."""
    N, C, P = Jx.shape
    Jx, Jz = Jx.reshape(N * C, P), Jz.reshape(-1, P)
    lam = torch.block_diag(*_lam(fx, likelihood, sigma))
    if likelihood == "regression":
        loglik = -0.5 * ((y - fx) ** 2).sum() / sigma**2
        loglik = loglik - N * C * math.log(sigma * math.sqrt(2 * math.pi))
    else:
        loglik = -torch.nn.functional.cross_entropy(fx, y, reduction="sum")
    Kxx, Kzx, Kzz = Jx @ Jx.T / prec, Jz @ Jx.T / prec, Jz @ Jz.T / prec
    Q = Kzx.T @ torch.linalg.solve(Kzz, Kzx)
    e, U = torch.linalg.eigh(lam)
    R = U @ torch.diag(e.clamp_min(0).sqrt()) @ U.T
    logdet = torch.logdet(torch.eye(N * C, dtype=F64) + R @ Q @ R)
    trace = torch.trace(lam @ (Kxx - Q))
    theta = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    return loglik - 0.5 * (prec * theta @ theta + logdet + trace)


@pytest.mark.parametrize("name", ["residual-shared", "cnn"])
def test_evidence_gradient_in_the_locations_equals_central_differences(name):
    model, x, y, z, _ = _problem(name, "classification")
    backend = DiffBackPackGGN(model, "classification")
    Z = z.clone().requires_grad_()
    prec, sigma = torch.tensor(2.0, dtype=F64), torch.tensor(1.0, dtype=F64)
    _evidence_gradient.evidence_loss_backward(
        backend, Z, (x, y), "classification", prec, sigma, jitter=0.0, batch_size=5
    )
    assert Z.grad is not None

    def loss(t: torch.Tensor) -> torch.Tensor:
        Jx, fx = (u.detach() for u in loop_jacobians(model, x))
        Jz, _ = (u.detach() for u in loop_jacobians(model, t))
        return -_dense_bound(model, Jx, fx, Jz, y, "classification", 2.0, 1.0)

    direction = torch.randn(z.shape, generator=torch.Generator().manual_seed(5))
    direction = direction.to(F64)
    expected = central_difference(lambda t: loss(z + t * direction), 1e-5)
    torch.testing.assert_close(
        (Z.grad * direction).sum(), expected, rtol=1e-5, atol=1e-8
    )


def test_fit_update_predict_and_evidence_never_write_more_than_one_block(
    assembled_widths,
):
    model, x, y, z, xs = _problem("cnn", "classification")
    cp = ContextPosterior(model, "classification", z, predictive_mean="dual")
    cp.fit((x[:8], y[:8])).update(x[8:], y[8:])
    cp(xs)
    cp.joint_predictive(xs[None])
    cp.log_marginal_likelihood()
    assert assembled_widths, "the convolutions' blocks should take the block route"
    assert all(n == 1 for n in assembled_widths)
    P, MC = sum(p.numel() for p in model.parameters()), len(z) * 3
    largest = max(t.numel() for t in cp.state_dict()["accumulators"].values()
                  if isinstance(t, torch.Tensor))  # fmt: skip
    assert largest < MC * P  # what is kept of the locations is not J_Z


def test_a_state_of_the_previous_format_loads_to_the_same_posterior():
    model, x, y, z, xs = _problem("residual-shared", "regression")
    kw = dict(prior_precision=torch.linspace(0.5, 2.0, 6, dtype=F64))
    cp = ContextPosterior(model, "regression", z, **kw).fit((x, y))
    state = cp.state_dict()
    acc = dict(state["accumulators"])
    # format 2 kept G = L₀⁻¹ J_Z diag(w) and √w instead of the whitened Grams
    Jz, _ = loop_jacobians(model, z)
    weight = acc.pop("weight")
    acc.pop("C")
    G = torch.linalg.solve_triangular(
        acc["L0"], Jz.detach().flatten(0, 1) * weight, upper=False
    )
    acc.update(G=G.reshape(Jz.shape), sqrt_w=weight.sqrt())
    old = dict(state, format="laplace_diffjac.ContextPosterior/2", accumulators=acc)
    loaded = ContextPosterior(model, "regression", z, **kw)
    loaded.load_state_dict(old)
    for a, b in zip(loaded(xs), cp(xs)):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(
        loaded.log_marginal_likelihood(), cp.log_marginal_likelihood(), **TOL
    )


def test_joint_blocks_of_many_q_batches_equal_the_dense_covariance():
    """More q-batches than one contraction takes (``_JOINT_INPUTS``), so several."""
    model, x, y, z, _ = _problem("residual-shared", "regression")
    _, xs = built("residual-shared", 25 * 3, seed=6)
    cp = ContextPosterior(
        model, "regression", z, sigma_noise=0.3, prior_precision=2.0, jitter=0.0
    ).fit((x, y))
    cov, _ = _dense(model, x, y, z, xs, "regression", 2.0, 0.3)
    _, joint = cp.joint_predictive(xs.reshape(25, 3, -1))
    dense = cov.reshape(25, 9, 25, 9).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    torch.testing.assert_close(joint, dense, **TOL)
