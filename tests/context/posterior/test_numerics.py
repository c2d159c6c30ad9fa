"""The context posterior's numbers do not depend on rounding.

Float64 throughout: the same data in other batches, ``update`` against a refit,
``Z = X`` against laplace-torch's own ``FullLaplace`` evidence, ``M`` up to ``N``
with the default jitter, and a float32 model against its float64 copy, for a
regression with a gap and a three-class problem. The whitened sums (accumulated
batch by batch in the frame of ``K_ZZ``) keep these to ``1e-9``; the unwhitened
form they replaced moved the variance by ``1e-3`` with the batch size.
"""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import FullLaplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import ContextPosterior

F64 = torch.float64


def _regression(n: int = 160):
    gen = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.rand(n // 2, 1, generator=gen) * 2 - 3,
            torch.rand(n - n // 2, 1, generator=gen) * 2 + 1,
        ]
    ).to(F64)
    y = torch.sin(2 * x) + 0.1 * torch.randn(x.shape, generator=gen, dtype=F64)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 1)
    ).to(F64)
    grid = torch.linspace(-4, 4, 41, dtype=F64).unsqueeze(1)
    return model, x, y, grid, dict(sigma_noise=0.1, prior_precision=1.0)


def _classification(n: int = 120):
    gen = torch.Generator().manual_seed(1)
    y = torch.arange(n) % 3
    centres = torch.tensor([[0.0, 2.0], [-2.0, -1.0], [2.0, -1.0]], dtype=F64)
    x = centres[y] + torch.randn(n, 2, generator=gen, dtype=F64)
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(2, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
    ).to(F64)
    grid = torch.randn(30, 2, generator=gen, dtype=F64) * 3
    return model, x, y, grid, dict(prior_precision=1.0)


def _trained_gap_regression():
    """N = 400 with a gap, a trained 1-50-50-1 tanh MLP: float32 rounding shows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.rand(200, 1, generator=gen) * 2 - 3,
            torch.rand(200, 1, generator=gen) * 2 + 1,
        ]
    ).to(F64)
    y = torch.sin(2 * x) + 0.1 * torch.randn(x.shape, generator=gen, dtype=F64)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 1)
    ).to(F64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
    grid = torch.linspace(-4, 4, 41, dtype=F64).unsqueeze(1)
    return model, x, y, grid, dict(sigma_noise=0.1, prior_precision=1.0)


PROBLEMS = {"regression": _regression, "classification": _classification}
FLOAT32_PROBLEMS = {
    "regression": _trained_gap_regression,
    "classification": _classification,
}


def _locations(x: torch.Tensor, m: int) -> torch.Tensor:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(2))
    return x[order[:m]]


def _fit(likelihood, model, x, y, Z, batch_size, **hyper):
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    return ContextPosterior(model, likelihood, Z, **hyper).fit(loader)


def _variance(cp, grid) -> torch.Tensor:
    out = cp(grid)
    if isinstance(out, tuple):
        return out[1]
    Js, _ = cp.backend.jacobians(grid)
    return cp.functional_variance(Js)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-300)).max())


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("m", [8, 16, 64, "N"])
def test_variance_and_evidence_do_not_depend_on_the_batch_size(likelihood, m):
    model, x, y, grid, hyper = PROBLEMS[likelihood]()
    Z = x if m == "N" else _locations(x, m)
    one = _fit(likelihood, model, x, y, Z, len(x), **hyper)
    small = _fit(likelihood, model, x, y, Z, 16, **hyper)
    diag = lambda v: v.diagonal(dim1=-2, dim2=-1)  # noqa: E731
    assert _rel(diag(_variance(small, grid)), diag(_variance(one, grid))) < 1e-9
    a, b = small.log_marginal_likelihood(), one.log_marginal_likelihood()
    assert abs(float(a - b)) < 1e-9 * abs(float(b))


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_update_equals_a_refit(likelihood):
    model, x, y, grid, hyper = PROBLEMS[likelihood]()
    Z = _locations(x, 32)
    half = len(x) // 2
    refit = _fit(likelihood, model, x, y, Z, 16, **hyper)
    updated = _fit(likelihood, model, x[:half], y[:half], Z, 16, **hyper)
    updated.update(x[half:], y[half:])
    diag = lambda v: v.diagonal(dim1=-2, dim2=-1)  # noqa: E731
    assert _rel(diag(_variance(updated, grid)), diag(_variance(refit, grid))) < 1e-9
    a, b = updated.log_marginal_likelihood(), refit.log_marginal_likelihood()
    assert abs(float(a - b)) < 1e-9 * abs(float(b))


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_locations_at_the_data_give_full_laplace_evidence(likelihood):
    """``Z = X`` (``M = N``, default jitter) against laplace-torch's own backend."""
    model, x, y, _, hyper = PROBLEMS[likelihood]()
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    full = FullLaplace(model, likelihood, **hyper)  # laplace-torch's default backend
    full.fit(loader)
    cp = ContextPosterior(model, likelihood, x, **hyper).fit(loader)
    for prec in (0.3, 1.0, 3.0):
        p = torch.tensor([prec], dtype=F64)
        expected = full.log_marginal_likelihood(p)
        got = cp.log_marginal_likelihood(p)
        assert abs(float(got - expected)) < 1e-6 * abs(float(expected)), prec


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_a_float32_model_agrees_with_its_float64_copy(likelihood):
    """Computed in float64 inside (a copy), returned in float32.

    In float32 throughout, the regression's variances were 1.6e-4 away.
    """
    model, x, y, grid, hyper = FLOAT32_PROBLEMS[likelihood]()
    model32 = copy.deepcopy(model).float()
    Z = _locations(x, 16)
    cp64 = _fit(likelihood, model, x, y, Z, 32, **hyper)
    y32 = y.float() if y.is_floating_point() else y
    cp32 = _fit(likelihood, model32, x.float(), y32, Z.float(), 32, **hyper)
    out64, out32 = cp64(grid), cp32(grid.float())
    for a, b in zip(
        out32 if isinstance(out32, tuple) else (out32,),
        out64 if isinstance(out64, tuple) else (out64,),
    ):
        assert a.dtype == torch.float32
        assert _rel(a.double(), b) < 1e-4
    e32, e64 = cp32.log_marginal_likelihood(), cp64.log_marginal_likelihood()
    assert abs(float(e32 - e64)) < 1e-4 * abs(float(e64))
    # the public backend is still the model's own: its Jacobians go in as they are
    Js, _ = cp32.backend.jacobians(grid.float())
    assert Js.dtype == torch.float32
    var = cp32.functional_variance(Js)
    assert var.dtype == torch.float32
    ref = cp64.functional_variance(cp64.backend.jacobians(grid)[0])
    assert (
        _rel(var.diagonal(dim1=-2, dim2=-1).double(), ref.diagonal(dim1=-2, dim2=-1))
        < 1e-3
    )
