"""Predictions from the Linear layers' inputs and signals: dense numbers, routes kept.

Where every parameter is a plain ``nn.Linear``'s and the prior is one scalar, the
context posterior's predictions contract the layers' inputs and output signals
(``_linear_predictions``) instead of ``J`` or the factors. The joint
covariances of q-batches, the per-input variances and their gradients in the
test inputs must equal dense float64 formulas written with the per-sample
autograd loop's Jacobians (``create_graph=True``), and central differences; other
models, priors, means and chunked locations must keep the route of the fit.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from laplace_diffjac import ContextPosterior, memory_budget
from laplace_diffjac.context.posterior._linear_predictions import LinearPredictions
from tests.context.helpers import _lam, small_cnn, small_mlp
from tests.references import loop_jacobians

F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}
PREC = 2.0
#: Where predictions ask for the Linear layers' features.
PREDICTIVE_MODULE = importlib.import_module(
    "laplace_diffjac.context.posterior._context_predictive"
)


class _ResidualMLP(nn.Module):
    """Linear layers outside a ``Sequential``: a skip and a layer without bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(4, 8)
        self.middle = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        return self.out(torch.tanh(self.middle(h)) + h)


class _TokenMLP(nn.Module):
    """A Linear layer over tokens ``(B, 2, 2)``: the engine gives factors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Linear(2, 3)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.tokens(x)).flatten(1))


MODELS = {
    "sequential": lambda: small_mlp(),
    "residual": lambda: _ResidualMLP().double(),
}


def _data(model: nn.Module, likelihood: str, shape: tuple[int, ...] = (4,)):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, *shape, generator=gen, dtype=F64)
    xs = torch.randn(6, *shape, generator=gen, dtype=F64)
    with torch.no_grad():
        f = model(x)
    if likelihood == "regression":
        y = f + 0.3 * torch.randn(f.shape, generator=gen, dtype=F64)
    else:
        y = torch.randint(0, 3, (len(x),), generator=gen)
    return x, y, x[:5].clone(), xs


def _posterior(model, likelihood, x, y, z, **kwargs) -> ContextPosterior:
    sigma = {"sigma_noise": 0.3} if likelihood == "regression" else {}
    return ContextPosterior(
        model, likelihood, z, prior_precision=kwargs.pop("prior_precision", PREC),
        jitter=0.0, enable_backprop=True, **sigma, **kwargs,
    ).fit((x, y))  # fmt: skip


def _dense_joint(model, likelihood, x, z, xs, q: int):
    """Mean and joint covariances of consecutive ``q`` test inputs, written out.

    ``K** − K*Z (K_ZZ⁻¹ − (K_ZZ + K_ZX Λ K_XZ)⁻¹) K_Z*`` with ``K = J Jᵀ / δ`` from
    the per-sample autograd loop's Jacobians; differentiable in ``xs``.
    """
    sigma = 0.3 if likelihood == "regression" else 1.0
    Jx, fx = (t.detach() for t in loop_jacobians(model, x))
    Jz, _ = (t.detach() for t in loop_jacobians(model, z))
    Js, fs = loop_jacobians(model, xs)
    C = Js.shape[1]
    Jx, Jz, Js = Jx.flatten(0, 1), Jz.flatten(0, 1), Js.flatten(0, 1)
    lam = torch.block_diag(*_lam(fx, likelihood, sigma))
    Kzz, Kzx, Kzs = Jz @ Jz.T / PREC, Jz @ Jx.T / PREC, Jz @ Js.T / PREC
    inner = Kzz + Kzx @ lam @ Kzx.T
    middle = torch.linalg.inv(Kzz) - torch.linalg.inv(inner)
    cov = Js @ Js.T / PREC - Kzs.T @ middle @ Kzs
    n = len(xs) // q
    blocks = cov.view(n, q * C, n, q * C).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    return fs, blocks


@pytest.mark.parametrize("structured", [True, False])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_predictions_from_linear_layers_equal_the_dense_formulas(
    name, likelihood, structured
):
    model = MODELS[name]()
    x, y, z, xs = _data(model, likelihood)
    cp = _posterior(model, likelihood, x, y, z, structured=structured)
    assert isinstance(cp._linear, LinearPredictions)  # the route taken
    xs_ours = xs.clone().requires_grad_(True)
    xs_ref = xs.clone().requires_grad_(True)
    mean, cov = cp.joint_predictive(xs_ours.view(2, 3, 4))
    ref_mean, ref_cov = _dense_joint(model, likelihood, x, z, xs_ref, q=3)
    torch.testing.assert_close(mean.reshape(6, -1), ref_mean, **TOL)
    torch.testing.assert_close(cov.reshape(2, 9, 9), ref_cov, **TOL)
    # per input: the diagonal blocks of the joint
    _, var = cp._glm_predictive_distribution(xs)
    C = ref_mean.shape[1]
    per_input = ref_cov.view(2, 3, C, 3, C).diagonal(dim1=1, dim2=3)
    torch.testing.assert_close(
        var, per_input.permute(0, 3, 1, 2).reshape(6, C, C), **TOL
    )
    # gradients in the test inputs, through the loop's create_graph Jacobians
    weights = torch.linspace(-1.0, 2.0, 81, dtype=F64).view(9, 9)
    (g_ours,) = torch.autograd.grad(
        (cov * weights).sum() + (mean * mean).sum(), xs_ours
    )
    (g_ref,) = torch.autograd.grad(
        (ref_cov * weights).sum() + (ref_mean * ref_mean).sum(), xs_ref
    )
    torch.testing.assert_close(g_ours, g_ref, **TOL)
    assert all(p.grad is None for p in model.parameters())


def test_gradients_match_central_differences_to_second_order():
    model = _ResidualMLP().double()
    x, y, z, xs = _data(model, "regression")
    cp = _posterior(model, "regression", x, y, z)
    assert cp._linear is not None
    xs = xs[:4].view(2, 2, 4).clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: cp.joint_predictive(t), (xs,))
    assert torch.autograd.gradgradcheck(lambda t: cp.joint_predictive(t), (xs,))


def _refuse_linear(*args, **kwargs):
    raise AssertionError("predictions took the Linear layers' route")


@pytest.mark.parametrize(
    "case", ["layerwise prior", "diagonal prior", "dual mean", "cnn", "tokens"]
)
def test_other_priors_means_and_models_keep_the_fits_route(case, monkeypatch):
    model = _TokenMLP().double() if case == "tokens" else small_mlp()
    model = small_cnn() if case == "cnn" else model
    shape = {"cnn": (1, 8, 8), "tokens": (2, 2)}.get(case, (4,))
    x, y, z, xs = _data(model, "regression", shape)
    n_params = sum(p.numel() for p in model.parameters())
    kwargs: dict = {
        "layerwise prior": {"prior_precision": torch.linspace(1.0, 3.0, 6).double()},
        "diagonal prior": {"prior_precision": torch.full((n_params,), PREC, dtype=F64)},
        "dual mean": {"predictive_mean": "dual"},
    }.get(case, {})
    cp = _posterior(model, "regression", x, y, z, **kwargs)
    if case == "dual mean":
        assert cp._linear is not None  # kept for a later 'network'
    else:
        assert cp._linear is None
    monkeypatch.setattr(PREDICTIVE_MODULE, "linear_layer_batch", _refuse_linear)
    mean, cov = cp.joint_predictive(xs.view(2, 3, *shape))
    assert torch.isfinite(cov).all() and cov.shape == (2, 9, 9)
    if case in ("cnn", "tokens"):  # the same scalar prior: the dense formulas
        ref_mean, ref_cov = _dense_joint(model, "regression", x, z, xs, q=3)
        torch.testing.assert_close(cov, ref_cov.detach(), **TOL)
        torch.testing.assert_close(mean.reshape(6, -1), ref_mean.detach(), **TOL)


def test_chunked_locations_keep_the_fits_route():
    model = small_mlp()
    x, y, z, xs = _data(model, "regression")
    with memory_budget(12000):
        cp = _posterior(model, "regression", x, y, z, batch_size=2)
    assert cp._chunks is not None and not cp._chunks.whole
    assert cp._linear is None


def test_a_vector_prior_variance_is_refused_by_the_linear_features():
    model = small_mlp()
    x, y, z, _ = _data(model, "regression")
    cp = _posterior(model, "regression", x, y, z)
    assert cp._linear is not None
    with pytest.raises(ValueError, match="one scalar prior variance"):
        cp._linear.locations.self_blocks(torch.ones(3, dtype=F64))


def test_a_loaded_state_predicts_on_the_linear_route_as_the_saved_one():
    model = small_mlp()
    x, y, z, xs = _data(model, "regression")
    saved = _posterior(model, "regression", x, y, z)
    loaded = ContextPosterior(model, "regression", z[:2], sigma_noise=0.3)
    loaded.load_state_dict(saved.state_dict())
    assert isinstance(loaded._linear, LinearPredictions)
    for ours, ref in zip(loaded.joint_predictive(xs), saved.joint_predictive(xs)):
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-14)
