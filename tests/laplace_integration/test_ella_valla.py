"""ELLA (``functional_approximation='nystrom'``) and VaLLA (``'variational'``).

Both exist only in laplace-torch 0.3. The adapter reports our backends as not
BackPACK-extending there (``_uses_backpack_backend`` is ``False``), so ELLA takes
its ``torch.func`` JVP route, which upstream forbids only because BackPACK hooks
break ``torch.func``.
"""

from __future__ import annotations

import pytest
import torch
from laplace import Laplace

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from tests.conftest import ON_LAPLACE_03

from .helpers import (
    assert_close,
    backends,
    base_model,
    fit,
    fit_pair,
    likelihoods,
    n_outputs_for,
    query_inputs,
    train_loader,
    upstream_quiet,
)

pytestmark = pytest.mark.skipif(
    not ON_LAPLACE_03, reason="ELLA and VaLLA were added in laplace-torch 0.3"
)


def _ella(backend, likelihood):
    return fit(
        backend,
        likelihood,
        "all",
        "gp",
        functional_approximation="nystrom",
        subsample_size=8,
        n_eigenvalues=4,
    )


def _ella_results(la) -> dict[str, object]:
    x = query_inputs()
    return {
        "gram": la.feature_gram,
        "chol": la.chol_precision,
        "marginal": la._glm_predictive_distribution(x),
        "joint": la._glm_predictive_distribution(x, joint=True),
        "call": la(x),
    }


@likelihoods
@backends
def test_ella_equals_default_backend(backend, likelihood):
    from laplace import ELLA

    ours, theirs = _ella(backend, likelihood), _ella(None, likelihood)
    assert isinstance(ours, ELLA) and ours._backend_cls is backend
    assert ours._uses_backpack_backend is False
    expected = _ella_results(theirs)
    for key, value in _ella_results(ours).items():
        assert_close(value, expected[key], key)


def test_ella_equals_upstream_backpack():
    ours, theirs = fit_pair(
        DiffBackPackGGN,
        "regression",
        "all",
        "gp",
        functional_approximation="nystrom",
        subsample_size=8,
        n_eigenvalues=4,
    )
    assert theirs._uses_backpack_backend is True  # upstream's route unchanged
    with upstream_quiet():
        expected = _ella_results(theirs)
    for key, value in _ella_results(ours).items():
        assert_close(value, expected[key], key)


def test_ella_input_gradients_with_enable_backprop():
    """Gradient of the ELLA predictive w.r.t. x equals the default backend's."""
    grads = []
    for backend in (DiffFuncGGN, None):
        la = fit(
            backend,
            "regression",
            "all",
            "gp",
            functional_approximation="nystrom",
            subsample_size=8,
            n_eigenvalues=4,
            enable_backprop=True,
        )
        x = query_inputs(requires_grad=True)
        mu, var = la(x)
        grads.append(torch.autograd.grad(mu.sum() + var.sum(), x)[0])
    assert grads[0].abs().sum() > 0
    assert_close(grads[0], grads[1], "d predictive / dx")


def _valla(backend, likelihood: str, iterations: int = 15):
    c = n_outputs_for(likelihood)
    model = base_model(c)
    loader = train_loader(likelihood, batch_size=12)  # one batch: exact objective
    Z = loader.dataset.tensors[0][:4].clone()
    la = Laplace(
        model,
        likelihood,
        "all",
        "gp",
        functional_approximation="variational",
        inducing_locations=Z,
        backend=backend,
        seed=0,
    )
    la.fit(loader, iterations=iterations, lr=5e-2)
    return la, Z


@pytest.mark.parametrize(
    "backend", [DiffBackPackGGN, DiffFuncGGN], ids=lambda b: b.__name__
)
def test_valla_moves_inducing_points_and_matches_default(backend):
    from laplace import VaLLA

    ours, Z = _valla(backend, "regression")
    theirs, _ = _valla(None, "regression")
    assert isinstance(ours, VaLLA) and ours._backend_cls is backend
    assert (ours.inducing_locations.detach() - Z).abs().max() > 1e-3
    history = ours.fit_history_["objective"]
    assert history[-1] < history[0]
    assert_close(history, theirs.fit_history_["objective"], "objective")
    assert_close(ours.inducing_locations, theirs.inducing_locations, "locations")
    x = query_inputs()
    assert_close(ours(x), theirs(x), "predictive")


def test_valla_classification_with_ef_jacobians():
    """VaLLA uses Jacobians only, so DiffBackPackEF serves it too."""
    ours, Z = _valla(DiffBackPackEF, "classification", iterations=5)
    theirs, _ = _valla(None, "classification", iterations=5)
    assert_close(ours.inducing_locations, theirs.inducing_locations, "locations")
    assert_close(
        ours.fit_history_["objective"], theirs.fit_history_["objective"], "objective"
    )
