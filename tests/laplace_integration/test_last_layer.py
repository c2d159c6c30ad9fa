"""Last-layer flavours (FullLL, DiagLL, KronLL) against laplace-torch's own."""

from __future__ import annotations

import pytest
from laplace import LLLaplace

from .helpers import (
    HAS_KRON,
    assert_close,
    assert_same_predictive,
    backends,
    fit,
    fit_pair,
    likelihoods,
)


def _posterior(la, structure: str) -> dict[str, object]:
    if structure == "full":
        return {"precision": la.posterior_precision, "cov": la.posterior_covariance}
    if structure == "diag":
        return {"precision": la.posterior_precision, "var": la.posterior_variance}
    return {"factors": la.H_facs, "precision": la.posterior_precision.to_matrix()}


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
@likelihoods
@backends
def test_last_layer_equals_upstream(backend, likelihood, structure):
    if structure == "kron" and backend not in HAS_KRON:
        with pytest.raises(NotImplementedError):
            fit(backend, likelihood, "last_layer", structure)
        return
    ours, theirs = fit_pair(backend, likelihood, "last_layer", structure)
    assert isinstance(ours, LLLaplace) and ours._backend_cls is backend
    expected = _posterior(theirs, structure)
    for key, value in _posterior(ours, structure).items():
        assert_close(value, expected[key], key)
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    assert_same_predictive(ours, theirs)
