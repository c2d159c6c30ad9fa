"""All-weights parametric flavours (Full, Diag, Kron) against laplace-torch's own."""

from __future__ import annotations

import pytest
from laplace import DiagLaplace, FullLaplace, KronLaplace

from .helpers import (
    HAS_KRON,
    assert_close,
    assert_same_predictive,
    backends,
    fit,
    fit_pair,
    likelihoods,
    upstream_quiet,
)


@likelihoods
@backends
def test_full_equals_upstream(backend, likelihood):
    ours, theirs = fit_pair(backend, likelihood, "all", "full")
    assert isinstance(ours, FullLaplace) and ours._backend_cls is backend
    assert_close(ours.posterior_precision, theirs.posterior_precision, "precision")
    assert_close(ours.posterior_covariance, theirs.posterior_covariance, "cov")
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    assert_same_predictive(ours, theirs)


@likelihoods
@backends
def test_diag_equals_upstream(backend, likelihood):
    ours, theirs = fit_pair(backend, likelihood, "all", "diag")
    assert isinstance(ours, DiagLaplace) and ours._backend_cls is backend
    assert_close(ours.posterior_precision, theirs.posterior_precision, "precision")
    assert_close(ours.posterior_variance, theirs.posterior_variance, "variance")
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    assert_same_predictive(ours, theirs)


@likelihoods
@backends
def test_kron_equals_upstream_or_is_refused_alike(backend, likelihood):
    if backend not in HAS_KRON:
        # DiffBackPackEF has no KFAC, as BackPackEF.
        with pytest.raises(NotImplementedError):
            fit(backend, likelihood, "all", "kron")
        return
    ours, theirs = fit_pair(backend, likelihood, "all", "kron")
    assert isinstance(ours, KronLaplace) and ours._backend_cls is backend
    assert_close(ours.H_facs, theirs.H_facs, "kron factors")
    assert_close(
        ours.posterior_precision.to_matrix(),
        theirs.posterior_precision.to_matrix(),
        "precision",
    )
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    assert_same_predictive(ours, theirs)


def test_upstream_backpackef_has_no_kron_either():
    from laplace.curvature import BackPackEF

    with upstream_quiet(), pytest.raises(NotImplementedError):
        fit(BackPackEF, "regression", "all", "kron")
