"""Subnetwork flavours (FullSubnet, DiagSubnet) against laplace-torch's own.

laplace-torch offers subnetwork Laplace only with ``full`` and ``diag`` Hessians.
"""

from __future__ import annotations

import pytest
from laplace import SubnetLaplace
from laplace.utils import LargestMagnitudeSubnetMask

from .helpers import (
    assert_close,
    assert_same_predictive,
    backends,
    base_model,
    fit_pair,
    likelihoods,
    n_outputs_for,
)


def _indices(likelihood: str):
    model = base_model(n_outputs_for(likelihood))
    return LargestMagnitudeSubnetMask(model, n_params_subnet=12).select()


@pytest.mark.parametrize("structure", ["full", "diag"])
@likelihoods
@backends
def test_subnetwork_equals_upstream(backend, likelihood, structure):
    indices = _indices(likelihood)
    ours, theirs = fit_pair(
        backend, likelihood, "subnetwork", structure, subnetwork_indices=indices
    )
    assert isinstance(ours, SubnetLaplace) and ours._backend_cls is backend
    assert ours.posterior_precision.shape[-1] == 12
    assert_close(ours.posterior_precision, theirs.posterior_precision, "precision")
    assert_close(ours.log_marginal_likelihood(), theirs.log_marginal_likelihood())
    assert_same_predictive(ours, theirs)
