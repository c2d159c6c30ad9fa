"""``patch_laplace()``: pipelines naming BackPackGGN/BackPackEF run on ours."""

from __future__ import annotations

import pytest
from laplace import (
    DiagLaplace,
    FullLaplace,
    FunctionalLaplace,
    FunctionalLLLaplace,
    KronLaplace,
    Laplace,
    marglik_training,
)
from laplace.baselaplace import BaseLaplace
from laplace.curvature import BackPackEF, BackPackGGN, CurvlinopsGGN

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, patch_laplace
from laplace_diffjac.laplace_integration._drop_in import is_patched
from laplace_diffjac.laplace_integration._registration import (
    is_registered,
    register,
    unregister,
)
from tests.references import assert_same_state, model_state

from .helpers import assert_close, base_model, fit, train_loader, upstream_quiet

pytestmark = pytest.mark.filterwarnings(
    "ignore:The prior precision has.* changed since fit"
)


def test_context_manager_redirects_and_restores():
    init = vars(BaseLaplace)["__init__"]
    with patch_laplace() as handle:
        assert handle.active and is_patched()
        la = Laplace(base_model(2), "regression", "all", "diag", backend=BackPackGGN)
        ef = Laplace(base_model(2), "regression", "all", "full", backend=BackPackEF)
    assert la._backend_cls is DiffBackPackGGN
    assert ef._backend_cls is DiffBackPackEF
    assert not handle.active and not is_patched()
    assert vars(BaseLaplace)["__init__"] is init
    after = Laplace(base_model(2), "regression", "all", "diag", backend=BackPackGGN)
    assert after._backend_cls is BackPackGGN


def test_call_form_with_undo():
    handle = patch_laplace()
    try:
        la = DiagLaplace(base_model(2), "regression", backend=BackPackGGN)
        assert la._backend_cls is DiffBackPackGGN
    finally:
        handle.undo()
    handle.undo()  # idempotent
    assert not hasattr(handle, "restore")  # one action, one name
    assert not is_patched()


def test_nested_handles_released_in_any_order():
    init = vars(BaseLaplace)["__init__"]
    outer, inner = patch_laplace(), patch_laplace()
    outer.undo()
    assert is_patched()
    la = KronLaplace(base_model(2), "regression", backend=BackPackGGN)
    assert la._backend_cls is DiffBackPackGGN
    inner.undo()
    assert not is_patched() and vars(BaseLaplace)["__init__"] is init


def test_other_backends_pass_through():
    with patch_laplace():
        la = FullLaplace(base_model(2), "regression", backend=CurvlinopsGGN)
        default = FullLaplace(base_model(2), "regression")
    assert la._backend_cls is CurvlinopsGGN
    assert default._backend_cls is CurvlinopsGGN


@pytest.mark.parametrize("cls", [FunctionalLaplace, FunctionalLLLaplace])
def test_import_time_default_backpackggn_is_redirected(cls):
    """``backend=BackPackGGN`` captured as a default at import time."""
    with patch_laplace():
        la = cls(base_model(2), "regression", n_subset=6)
    assert la._backend_cls is DiffBackPackGGN
    la.fit(train_loader("regression"))
    assert isinstance(la.backend, DiffBackPackGGN)


def test_patched_pipeline_leaves_no_hooks_and_equals_upstream():
    model = base_model(2)
    before = model_state(model)
    with patch_laplace():
        la = fit(BackPackGGN, "regression", "all", "kron", model=model)
        # the same model object, fitted in place: nothing left on it
        in_place = Laplace(model, "regression", "all", "full", backend=BackPackGGN)
        in_place.fit(train_loader("regression"))
    del model.output_size  # set by laplace-torch's own fit(), not by the backend
    assert_same_state(before, model_state(model))
    with upstream_quiet():
        upstream = fit(BackPackGGN, "regression", "all", "kron", model=model)
    assert la._backend_cls is DiffBackPackGGN
    assert upstream._backend_cls is BackPackGGN
    assert_close(la.H_facs, upstream.H_facs, "kron factors")
    assert_close(la.log_marginal_likelihood(), upstream.log_marginal_likelihood())


def test_marglik_training_backend_is_redirected():
    with patch_laplace():
        la, *_ = marglik_training(
            base_model(2),
            train_loader("regression"),
            likelihood="regression",
            hessian_structure="diag",
            backend=BackPackEF,
            n_epochs=1,
            n_hypersteps=1,
        )
    assert la._backend_cls is DiffBackPackEF


def test_patch_registers_adapter_only_for_its_duration():
    assert is_registered()
    unregister()
    try:
        with patch_laplace():
            assert is_registered()
        assert not is_registered()
    finally:
        register()
    assert is_registered()


def test_a_backend_counts_as_ours_exactly_while_the_drop_in_swaps_it():
    """The distributed refusals see laplace-torch's BackPackGGN as ours when patched."""
    from laplace.curvature import BackPackGGN, CurvlinopsGGN

    from laplace_diffjac.laplace_integration._registration import _backend_is_ours

    assert _backend_is_ours(DiffBackPackGGN) and not _backend_is_ours(BackPackGGN)
    with patch_laplace():
        assert _backend_is_ours(BackPackGGN)
        assert not _backend_is_ours(CurvlinopsGGN)
    assert not _backend_is_ours(BackPackGGN)
