"""laplace-torch's factory builds a ContextPosterior while registered (0.3 only)."""

from __future__ import annotations

import laplace
import pytest
import torch
from laplace import FullLaplace

from laplace_diffjac import DiffBackPackGGN, register, unregister
from laplace_diffjac.context import ContextPosterior
from tests.conftest import CASES, ON_LAPLACE_03

pytestmark = pytest.mark.skipif(
    not ON_LAPLACE_03,
    reason="laplace-torch 0.2.3's factory has no functional_approximation; "
    "use ContextPosterior directly there",
)

MLP = CASES[1]


def _context(**kwargs):
    return laplace.Laplace(
        MLP.model(),
        "regression",
        subset_of_weights="all",
        hessian_structure="gp",
        functional_approximation="context",
        **kwargs,
    )


def test_factory_builds_the_context_posterior():
    x, z, xs = MLP.inputs(10, 1), MLP.inputs(4, 2), MLP.inputs(3, 3)
    la = _context(
        context_points=z, backend=DiffBackPackGGN, prior_precision=2.0, sigma_noise=0.4
    )
    assert isinstance(la, ContextPosterior)
    la.fit(x)
    direct = ContextPosterior(
        MLP.model(), "regression", z, prior_precision=2.0, sigma_noise=0.4
    ).fit(x)
    for a, b in zip(la(xs), direct(xs)):
        assert torch.equal(a, b)
    full = laplace.laplace.Laplace(MLP.model(), "regression", "all", "full")
    assert type(full) is FullLaplace


def test_factory_errors_name_the_fix():
    z = MLP.inputs(4, 2)
    with pytest.raises(ValueError, match="context_points"):
        _context()
    with pytest.raises(ValueError, match="subset_of_weights='all'"):
        laplace.Laplace(
            MLP.model(),
            "regression",
            subset_of_weights="last_layer",
            hessian_structure="gp",
            functional_approximation="context",
            context_points=z,
        )


def test_unregister_removes_and_register_reinstalls():
    z = MLP.inputs(4, 2)
    try:
        assert unregister()
        with pytest.raises(ValueError, match="functional_approximation"):
            _context(context_points=z)
    finally:
        register()
    assert isinstance(_context(context_points=z), ContextPosterior)
