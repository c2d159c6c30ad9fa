"""``register()``/``unregister()``: narrow, idempotent, exactly reversible, and
decided by type (``issubclass``), never by class name."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
from laplace import FunctionalLaplace, FunctionalLLLaplace, Laplace, baselaplace
from laplace.curvature import BackPackGGN, CurvlinopsGGN

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.laplace_integration._registration import (
    is_registered,
    is_side_effect_free,
    register,
    unregister,
)
from tests.conftest import ON_LAPLACE_03
from tests.processes import python_env

from .helpers import base_model, train_loader

pytestmark = pytest.mark.filterwarnings(
    "ignore:The prior precision has.* changed since fit"
)

BASE_FUNCTIONAL = getattr(baselaplace, "BaseFunctionalLaplace", None)


def _patched_entries() -> dict[str, object]:
    entries = {
        "BaseLaplace.__init__": vars(baselaplace.BaseLaplace)["__init__"],
        "FunctionalLaplace.__init__": vars(FunctionalLaplace)["__init__"],
    }
    if BASE_FUNCTIONAL is not None:
        entries["_uses_backpack_backend"] = vars(BASE_FUNCTIONAL)[
            "_uses_backpack_backend"
        ]
    return entries


@pytest.fixture
def unregistered():
    """Run a test without the adapter, re-registering afterwards."""
    assert is_registered()
    unregister()
    try:
        yield
    finally:
        register()


def test_registered_on_import_and_idempotent():
    assert is_registered()
    patched = _patched_entries()
    assert register() is False  # already installed: nothing changes
    assert _patched_entries() == patched


def test_unregister_restores_exact_objects(unregistered):
    originals = _patched_entries()
    assert unregister() is False  # idempotent
    assert register() is True
    assert all(_patched_entries()[key] is not originals[key] for key in originals), (
        "register() should replace each entry"
    )
    assert unregister() is True
    assert _patched_entries() == originals
    for key, value in _patched_entries().items():
        assert value is originals[key], key
    assert "__init__" in vars(FunctionalLaplace)
    assert "__init__" in vars(FunctionalLLLaplace)  # subclass untouched


def test_wrapper_keeps_signature_and_docs(unregistered):
    original = vars(FunctionalLaplace)["__init__"]
    register()
    try:
        wrapped = vars(FunctionalLaplace)["__init__"]
        assert inspect.signature(wrapped) == inspect.signature(original)
        assert wrapped.__doc__ == original.__doc__
        assert wrapped.__wrapped__ is original
    finally:
        unregister()


@pytest.mark.skipif(not __debug__, reason="upstream's refusal is an assert")
@pytest.mark.parametrize("backend", [DiffBackPackGGN, DiffFuncGGN])
def test_without_registration_upstream_refuses(unregistered, backend):
    with pytest.raises(AssertionError):
        FunctionalLaplace(base_model(2), "regression", n_subset=4, backend=backend)


@pytest.mark.parametrize("backend", [None, BackPackGGN, CurvlinopsGGN])
def test_other_backends_unchanged(backend):
    kwargs = {} if backend is None else {"backend": backend}
    la = FunctionalLaplace(base_model(2), "regression", n_subset=4, **kwargs)
    assert la._backend_cls is BackPackGGN if backend is None else backend
    if ON_LAPLACE_03:
        assert la._uses_backpack_backend is (la._backend_cls is BackPackGGN)


class Renamed(DiffFuncGGN):
    """A user subclass whose name says nothing about its base."""


class BackPackLookalike(CurvlinopsGGN):
    """Named like BackPACK, but it is not one of ours (nor BackPACK)."""


def test_unregister_refuses_while_patched_on_top():
    from laplace_diffjac import patch_laplace

    patched = _patched_entries()
    with patch_laplace():
        with pytest.raises(RuntimeError, match="patched again"):
            unregister()
        assert is_registered()
    assert is_registered()
    for key, value in _patched_entries().items():
        assert value is patched[key], key


def test_decisions_follow_type_not_name():
    assert is_side_effect_free(Renamed)
    assert not is_side_effect_free(BackPackLookalike)
    assert not is_side_effect_free(BackPackGGN)
    assert not is_side_effect_free("DiffFuncGGN")
    la = FunctionalLaplace(base_model(2), "regression", n_subset=4, backend=Renamed)
    assert la._backend_cls is Renamed
    la.fit(train_loader("regression"))
    assert isinstance(la.backend, Renamed)
    if __debug__:  # not ours: upstream's allow-list still applies
        with pytest.raises(AssertionError):
            FunctionalLaplace(
                base_model(2), "regression", n_subset=4, backend=BackPackLookalike
            )


@pytest.mark.skipif(not ON_LAPLACE_03, reason="ELLA/VaLLA exist in laplace-torch 0.3")
@pytest.mark.parametrize(
    "backend", [DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN, Renamed, BackPackGGN]
)
def test_uses_backpack_backend_only_for_hook_installing_backends(backend):
    la = Laplace(
        base_model(1),
        "regression",
        "all",
        "gp",
        functional_approximation="nystrom",
        subsample_size=4,
        n_eigenvalues=2,
        backend=backend,
    )
    assert la._uses_backpack_backend is (backend is BackPackGGN)


_OPTIMISED = textwrap.dedent(
    """
    import sys, torch
    assert not __debug__, "run with python -O"
    from torch.utils.data import DataLoader, TensorDataset
    import laplace_diffjac
    from laplace import FunctionalLaplace, Laplace
    from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN, patch_laplace
    from laplace.curvature import BackPackGGN
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                              torch.nn.Linear(4, 1)).double()
    X = torch.randn(8, 3, dtype=torch.float64)
    loader = DataLoader(TensorDataset(X, torch.randn(8, 1, dtype=torch.float64)),
                        batch_size=4)
    for backend in (DiffBackPackGGN, DiffFuncGGN):
        la = Laplace(net, "regression", "all", "gp", n_subset=4, backend=backend)
        assert la._backend_cls is backend
        la.fit(loader)
        assert isinstance(la.backend, backend)
        la(X[:2])
    with patch_laplace():
        la = FunctionalLaplace(net, "regression", n_subset=4)
    assert la._backend_cls is DiffBackPackGGN
    laplace_diffjac.unregister()
    la = FunctionalLaplace(net, "regression", n_subset=4, backend=DiffFuncGGN)
    assert la._backend_cls is DiffFuncGGN  # upstream's assert is gone under -O
    print("OPTIMISED-OK")
    """
)


@pytest.mark.slow
def test_works_under_python_O():
    """Acceptance does not rest on asserts: the same works with them stripped."""
    result = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMISED],
        # laplace-torch 0.2.3's FunctionalLaplace warns on its first prediction
        env=python_env("ignore:The prior precision has been changed:UserWarning"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OPTIMISED-OK" in result.stdout
