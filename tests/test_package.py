"""Importing the package changes nothing in laplace-torch's estimator lookup."""

from __future__ import annotations

import laplace
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
