"""Function-space flavours (FunctionalLaplace, FunctionalLLLaplace) on our backends.

laplace-torch's ``FunctionalLaplace`` asserts ``backend in [BackPackGGN, AsdlGGN,
CurvlinopsGGN]``; the adapter lets the GGN backends of this package through and
keeps ``DiffBackPackEF`` out, exactly as ``BackPackEF`` is.
"""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import FunctionalLaplace, FunctionalLLLaplace
from laplace.curvature import BackPackEF, BackPackGGN

from laplace_diffjac import DiffBackPackEF, DiffFuncGGN
from tests.conftest import ON_LAPLACE_03

from .helpers import (
    assert_close,
    base_model,
    fit,
    fit_pair,
    ggn_backends,
    likelihoods,
    n_outputs_for,
    query_inputs,
    train_loader,
    upstream_quiet,
)

# laplace-torch 0.2.3 warns on every prediction after fit (its flag that the prior
# changed is set in __init__ and never cleared); same for its own backends.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The prior precision has.* changed since fit"
)

FLAVOURS = {"all": FunctionalLaplace, "last_layer": FunctionalLLLaplace}


def _results(la) -> dict[str, object]:
    x = query_inputs()
    gen = torch.Generator().manual_seed(0)
    results = {
        "K_MM": la.K_MM,
        "Sigma_inv": la.Sigma_inv,
        "lml": la.log_marginal_likelihood(),
        "gp marginal": la._glm_predictive_distribution(x),
        "call": la(x),
        "samples": la.predictive_samples(x, n_samples=3, generator=gen),
    }
    # laplace-torch 0.2.3's joint kernel fails for independent outputs (an einsum
    # with a repeated output index), for its own backends as well.
    if ON_LAPLACE_03 or not la.independent_outputs:
        results["gp joint"] = la._glm_predictive_distribution(x, joint=True)
    return results


# laplace-torch advises against independent outputs for multivariate regression.
@pytest.mark.filterwarnings("ignore:Using FunctionalLaplace with the diagonal")
@pytest.mark.parametrize("independent_outputs", [False, True], ids=["dep", "indep"])
@pytest.mark.parametrize("subset", sorted(FLAVOURS))
@likelihoods
@ggn_backends
def test_functional_equals_upstream(backend, likelihood, subset, independent_outputs):
    ours, theirs = fit_pair(
        backend,
        likelihood,
        subset,
        "gp",
        n_subset=8,
        independent_outputs=independent_outputs,
    )
    assert type(ours) is FLAVOURS[subset] and ours._backend_cls is backend
    actual = _results(ours)
    with upstream_quiet():
        expected = _results(theirs)
    for key in expected:
        assert_close(actual[key], expected[key], key)


@pytest.mark.parametrize("cls", [FunctionalLaplace, FunctionalLLLaplace])
def test_direct_construction_with_positional_backend(cls):
    """The backend found by signature binding, whichever way it was passed."""
    model = base_model(2)
    args = (model, "regression", 8, 1.0, 1.0, 0.0, 1.0, False)
    if cls is FunctionalLLLaplace:
        args = (*args, None)  # feature_reduction
    args = (*args, "input_ids", "labels")
    if cls is FunctionalLLLaplace:
        args = (*args, None)  # last_layer_name
    la = cls(*args, DiffFuncGGN)
    assert la._backend_cls is DiffFuncGGN
    la.fit(train_loader("regression"))
    assert isinstance(la.backend, DiffFuncGGN)


@pytest.mark.skipif(not __debug__, reason="upstream's refusal is an assert")
@pytest.mark.parametrize("ef", [DiffBackPackEF, BackPackEF], ids=lambda b: b.__name__)
def test_empirical_fisher_is_refused_as_upstream(ef):
    with pytest.raises(AssertionError):
        FunctionalLaplace(base_model(2), "regression", n_subset=4, backend=ef)


def test_frozen_parameters_accepted_for_ours_only():
    """The requires-grad refusal is lifted for our backends, kept for BackPACK's."""
    from laplace_diffjac import DiffBackPackGGN

    model = base_model(2)
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="grad are switched off"):
        FunctionalLaplace(model, "regression", n_subset=4, backend=BackPackGGN)
    for backend in (DiffBackPackGGN, DiffFuncGGN):
        la = FunctionalLaplace(
            copy.deepcopy(model), "regression", n_subset=4, backend=backend
        )
        assert la._backend_cls is backend


@likelihoods
def test_fit_leaves_model_untouched(likelihood):
    from tests.references import assert_same_state, model_state

    model = base_model(n_outputs_for(likelihood))
    before = model_state(model)
    for backend in (DiffFuncGGN,):
        fit(backend, likelihood, "all", "gp", model=model, n_subset=8)
    assert_same_state(before, model_state(model))
