"""Importing the package changes nothing in laplace-torch's estimator lookup."""

from __future__ import annotations

import laplace
import torch
from laplace.baselaplace import BaseLaplace

import laplace_diffjac


def _subclasses(cls: type) -> set[type]:
    direct = set(cls.__subclasses__())
    return direct.union(*(_subclasses(c) for c in direct)) if direct else direct


def test_no_class_of_ours_shadows_a_laplace_torch_estimator():
    """laplace.Laplace(...) picks classes by ``_key``; ours must not claim one."""
    ours = [
        c
        for c in _subclasses(BaseLaplace)
        if c.__module__.startswith("laplace_diffjac")
    ]
    assert ours, "expected LocationFunctionalLaplace to be a BaseLaplace subclass"
    upstream_keys = {
        getattr(c, "_key", None)
        for c in _subclasses(BaseLaplace)
        if c.__module__.startswith("laplace.")
    }
    for cls in ours:
        key = getattr(cls, "_key", None)
        assert key is None or key not in upstream_keys, cls


def test_factory_still_returns_functional_laplace():
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(1, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
    )
    for _ in range(5):
        la = laplace.Laplace(
            model,
            "regression",
            subset_of_weights="all",
            hessian_structure="gp",
            n_subset=4,
        )
        assert type(la) is laplace.FunctionalLaplace
    assert laplace_diffjac.__version__


def _fresh_python(code: str, *, without: str):
    """Run ``code`` in a new interpreter, the environment less ``without``."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != without}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_using_the_package_sets_no_allocator_environment_variable():
    """No environment change, e.g. ``THP_MEM_ALLOC_ENABLE`` (the user's choice)."""
    code = (
        "import os\n"
        "before = dict(os.environ)\n"
        "import torch, laplace_diffjac\n"
        "m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),"
        " torch.nn.Linear(4, 2))\n"
        "x = torch.randn(5, 3, requires_grad=True)\n"
        "J, _ = laplace_diffjac.DiffBackPackGGN(m, 'regression')"
        ".jacobians(x, enable_backprop=True)\n"
        "torch.autograd.grad(J.sum(), x)\n"
        "print(sorted(set(os.environ.items()) ^ set(before.items())))\n"
    )
    out = _fresh_python(code, without="THP_MEM_ALLOC_ENABLE")
    assert out.stdout.strip() == "[]"


def test_importing_the_package_is_silent_and_leaves_the_filters_as_they_were():
    """A fresh interpreter, the user's default warning filters: a silent import.

    laplace-torch's import prints torch's ``torch.jit.script`` deprecation five
    times (its ASDL backend); the package silences that one warning around that
    one import, so nothing reaches stderr, and no filter of its outlives it.
    """
    code = (
        "import warnings\n"
        "before = list(warnings.filters)\n"
        "import laplace_diffjac\n"
        "print(list(warnings.filters) == before)\n"
    )
    out = _fresh_python(code, without="PYTHONWARNINGS")
    assert out.stderr == ""
    assert out.stdout == "True\n"


def test_the_license_is_at_the_root_and_in_the_installed_metadata():
    """``LICENSE`` (MIT) at the root, and the installed distribution carries it."""
    import importlib.metadata
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "Permission is hereby granted, free of charge" in text
    metadata = importlib.metadata.metadata("laplace-diffjac")
    assert metadata.get("License-Expression") == "MIT"
    assert "LICENSE" in (metadata.get_all("License-File") or [])
    files = importlib.metadata.distribution("laplace-diffjac").files or []
    licenses = [f for f in files if f.name == "LICENSE"]
    assert licenses and licenses[0].read_text() == text


def test_each_xdist_worker_gives_torch_its_share_of_the_cores(monkeypatch):
    """The README's ``-n 2``: each worker computes on cores // workers threads."""
    from tests import conftest

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        monkeypatch.setattr(conftest, "_cores", lambda: 5)
        conftest.pytest_configure(None)  # type: ignore[arg-type]
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "8")
        conftest.pytest_configure(None)  # type: ignore[arg-type]
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_dependency_admits_the_checked_laplace_releases_and_no_other():
    """pip must not pick a laplace-torch release the package was not checked on.

    laplace-torch 0.5.1 appeared on the package index with the package still
    declaring ``laplace-torch>=0.2.3``; a fresh install took it and 111 tests failed.
    The installed metadata (what pip reads) is checked, not the source file.
    """
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    from laplace_diffjac.laplace_integration._functional_laplace import (
        CHECKED_RELEASES,
    )

    (laplace_torch,) = [
        Requirement(r)
        for r in requires("laplace-diffjac") or []
        if Requirement(r).name == "laplace-torch" and Requirement(r).marker is None
    ]
    for release in CHECKED_RELEASES:
        assert laplace_torch.specifier.contains(".".join(map(str, release)))
    for unchecked in ("0.2.2", "0.4", "0.5.1"):
        assert not laplace_torch.specifier.contains(unchecked), unchecked
