"""One eigendecomposition for every scalar prior precision and noise.

The evidence and the predictions of a one-group posterior at a second ``(δ, σ)``
go through :class:`laplace_diffjac.context.posterior._factor_cache.ScalarSpectrum`;
the first of each is factorised by Cholesky. Each check compares against the
direct route: a fresh posterior's first evidence and prediction are Cholesky's,
and a posterior whose prior is split into equal layerwise groups factorises by
Cholesky for every prediction; float64, gradients in ``δ`` and ``σ`` included.
"""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac.context import ContextPosterior
from tests.conftest import CASES
from tests.context.helpers import ill_conditioned_problem

MLP = CASES[1]  # mlp-C3, P = 77


def _problem(likelihood: str, n: int = 30, m: int = 6):
    model = MLP.model()
    x = MLP.inputs(n, 2)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        f = model(x)
    y = (
        f + 0.3 * torch.randn(f.shape, generator=gen, dtype=f.dtype)
        if likelihood == "regression"
        else f.argmax(-1)
    )
    return model, x, y, x[:m].clone()


def _fresh_evidence(model, likelihood, Z, data, prec, sigma):
    """Value and gradients on a fresh posterior: its first evidence is Cholesky's."""
    cp = ContextPosterior(model, likelihood, Z).fit(data)
    prec = prec.clone().requires_grad_(True)
    sigma = None if sigma is None else sigma.clone().requires_grad_(True)
    value = cp.log_marginal_likelihood(prec, sigma)
    leaves = [prec] if sigma is None else [prec, sigma]
    return value.detach(), torch.autograd.grad(value, leaves)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_evidence_after_a_search_equals_the_direct_route(likelihood):
    model, x, y, Z = _problem(likelihood)
    cp = ContextPosterior(model, likelihood, Z).fit((x, y))
    cp.log_marginal_likelihood(torch.tensor([1.0]))  # a search starts
    regression = likelihood == "regression"
    for prec, sig in [(0.05, 0.2), (1.7, 0.6), (300.0, 2.0)]:
        prec_t = torch.tensor([prec], dtype=torch.float64)
        sigma = torch.tensor(sig, dtype=torch.float64) if regression else None
        want, want_grads = _fresh_evidence(model, likelihood, Z, (x, y), prec_t, sigma)
        p = prec_t.clone().requires_grad_(True)
        s = None if sigma is None else sigma.clone().requires_grad_(True)
        got = cp.log_marginal_likelihood(p, s)
        got_grads = torch.autograd.grad(got, [p] if s is None else [p, s])
        assert cp._factors._spectrum is not None  # the spectral route ran
        # two algorithms (eigenvalues vs Cholesky): 1e-10 failed by 1.8e-10 with
        # one BLAS thread at δ = 0.05, σ = 0.2
        torch.testing.assert_close(got.detach(), want, rtol=1e-9, atol=1e-10)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_predictions_at_a_changed_prior_equal_a_fresh_fit(likelihood):
    model, x, y, Z = _problem(likelihood)
    cp = ContextPosterior(model, likelihood, Z).fit((x, y))
    Js = cp.backend.jacobians(MLP.inputs(5, 9))[0]
    cp.functional_variance(Js)  # Cholesky at δ = 1; the next δ builds the spectrum
    assert cp._factors._spectrum is None
    for prec in (0.01, 3.0, 1e4):
        cp.prior_precision = prec
        # the same prior as equal layerwise groups: the keyed factorisation route
        layers = torch.full((cp.n_layers,), prec, dtype=torch.float64)
        ref = ContextPosterior(
            model, likelihood, Z, prior_precision=layers, prior_structure="layerwise"
        ).fit((x, y))
        assert len(ref._acc.bounds) > 1
        torch.testing.assert_close(
            cp.functional_variance(Js),
            ref.functional_variance(Js),
            rtol=1e-6,  # k** − Q** cancels ~2000-fold at δ = 0.01: rounding only
            atol=1e-12,
        )
        assert cp._factors._spectrum is not None


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_first_prediction_by_cholesky_equals_the_spectral_one(likelihood):
    model, x, y, Z = _problem(likelihood)
    xs = MLP.inputs(5, 9)
    first = ContextPosterior(model, likelihood, Z).fit((x, y))
    Js = first.backend.jacobians(xs)[0]
    var = first.functional_variance(Js)
    cov = first.functional_covariance(Js)
    assert first._factors._spectrum is None  # one (δ, σ): Cholesky only
    spectral = ContextPosterior(model, likelihood, Z).fit((x, y))
    spectral.log_marginal_likelihood(torch.tensor([2.0]))
    spectral.log_marginal_likelihood(torch.tensor([1.0]))  # back at δ = 1
    assert spectral._factors._spectrum is not None
    tol = dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(var, spectral.functional_variance(Js), **tol)
    torch.testing.assert_close(cov, spectral.functional_covariance(Js), **tol)


def test_update_forgets_the_spectrum():
    model, x, y, Z = _problem("regression")
    cp = _with_spectrum(ContextPosterior(model, "regression", Z), x[:20], y[:20])
    assert cp._factors._spectrum is not None
    cp.update(x[20:], y[20:])
    _assert_same_evidence(cp, ContextPosterior(model, "regression", Z).fit((x, y)))


def test_spectral_route_equals_cholesky_route_past_the_numerical_rank():
    model, x, y, Z = ill_conditioned_problem()
    spectral = ContextPosterior(model, "regression", Z, sigma_noise=0.01).fit((x, y))
    spectral(x[:3])  # Cholesky at δ = 1, then a second δ builds the spectrum
    spectral.prior_precision = 2.0
    spectral(x[:3])
    assert spectral._factors._spectrum is not None
    cholesky = ContextPosterior(model, "regression", Z, sigma_noise=0.01).fit((x, y))
    for d in (0.1, 1.0, 10.0):
        prec = torch.tensor([d], dtype=torch.float64)
        a = spectral.log_marginal_likelihood(prec)
        b = cholesky.log_marginal_likelihood(prec)  # first value: Cholesky
        torch.testing.assert_close(a, b, rtol=1e-10, atol=0)
        cholesky._factors.clear()


def test_load_state_dict_forgets_the_spectrum():
    model, x, y, Z = _problem("regression")
    cp = _with_spectrum(ContextPosterior(model, "regression", Z), x[:20], y[:20])
    other = ContextPosterior(model, "regression", Z).fit((x, y))
    cp.load_state_dict(other.state_dict())
    _assert_same_evidence(cp, ContextPosterior(model, "regression", Z).fit((x, y)))


def _with_spectrum(cp, x, y):
    """``cp`` fitted on ``(x, y)`` with its spectrum built (two evidence values)."""
    cp.fit((x, y))
    cp.log_marginal_likelihood(torch.tensor([1.0]))
    cp.log_marginal_likelihood(torch.tensor([2.0]))
    return cp


def _assert_same_evidence(cp, reference):
    torch.testing.assert_close(
        cp.log_marginal_likelihood(torch.tensor([2.0])),
        reference.log_marginal_likelihood(torch.tensor([2.0])),
        rtol=1e-10,
        atol=0,
    )
