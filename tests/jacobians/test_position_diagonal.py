"""The GGN diagonal of layers applied at several positions (``_position_diagonal``).

Convolutions of a small ResNet without batch norm (output positions 36, 9, 4 and
1, ``out += identity``) and a token transformer's Linear layers, by both routes
(the rows, chunked; the position Grams) and by the one the cost model picks: the
GGN diagonal (exact and Monte Carlo), the empirical Fisher's and ``diag(JᵀΛJ)``
with a given ``Λ`` against the float64 per-sample references of
``tests/curvature_references.py``, against the assembled Jacobian, and against
the block route every such layer took before (the Monte-Carlo draws are
reproduced by seeding).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN
from laplace_diffjac.jacobians import _factor_products, _position_diagonal
from laplace_diffjac.jacobians._engine import jacobian_factors
from tests.class_models import PlainBlock, built
from tests.curvature_references import ef_diagonal, exact_ggn

ROUTES = ["rows", "gram", "chosen"]
LIKELIHOODS = ["classification", "regression"]


def _resnet() -> nn.Module:
    """3×6×6 images through output positions 36, 9, 4 and 1, 3 classes."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, 1, 1),
        nn.ReLU(),
        PlainBlock(4, 4, 1),
        PlainBlock(4, 5, 2),
        PlainBlock(5, 6, 2),
        PlainBlock(6, 6, 2),
        nn.Flatten(),
        nn.Linear(6, 3),
    )
    return model.double().eval()


def _case(name: str) -> tuple[nn.Module, torch.Tensor]:
    if name == "resnet":
        gen = torch.Generator().manual_seed(1)
        return _resnet(), torch.randn(5, 3, 6, 6, generator=gen, dtype=torch.float64)
    return built(name, 5)


def _targets(likelihood: str, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    if likelihood == "classification":
        return torch.randint(0, 3, (n,), generator=gen)
    return torch.randn(n, 3, generator=gen, dtype=torch.float64)


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch) -> Iterator[str]:
    """Force one route of ``_position_diagonal`` (or leave the choice to it)."""
    if request.param != "chosen":
        gram = request.param == "gram"
        monkeypatch.setattr(_position_diagonal, "_gram_is_cheaper", lambda *args: gram)
    monkeypatch.setattr(_position_diagonal, "_CACHE_BYTES", 4096)  # many chunks
    yield request.param


def test_the_resnet_reaches_both_routes_and_a_single_position() -> None:
    model, x = _case("resnet")
    parts = jacobian_factors(model, x, list(model.parameters()))
    positions = {
        e.g.shape[3]
        for entries in parts.factors.values()
        for e in entries
        if isinstance(e, _factor_products.Product)
    }
    assert positions == {36, 9, 4, 1}


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("name", ["resnet", "token-transformer"])
def test_ggn_diagonal_equals_the_float64_reference(name, likelihood, route) -> None:
    model, x = _case(name)
    y = _targets(likelihood, 5)
    _, diag = DiffBackPackGGN(model, likelihood).diag(x, y)
    expected = exact_ggn(model, [(x, y)], likelihood).diagonal  # Λ with its factor
    torch.testing.assert_close(diag, expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("name", ["resnet", "token-transformer"])
def test_ef_diagonal_equals_the_float64_reference(name, likelihood, route) -> None:
    model, x = _case(name)
    y = _targets(likelihood, 5)
    _, diag = DiffBackPackEF(model, likelihood).diag(x, y)
    expected = ef_diagonal(model, [(x, y)], likelihood)
    torch.testing.assert_close(diag, expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
def test_monte_carlo_diagonal_equals_the_block_route(
    likelihood, route, monkeypatch
) -> None:
    model, x = _case("resnet")
    y = _targets(likelihood, 5)
    backend = DiffBackPackGGN(model, likelihood, stochastic=True)
    torch.manual_seed(3)
    _, diag = backend.diag(x, y)
    torch.manual_seed(3)
    with monkeypatch.context() as patch:  # every parameter by its block, as before
        patch.setattr(_factor_products, "_has_closed_form", lambda entry: False)
        _, before = backend.diag(x, y)
    torch.testing.assert_close(diag, before, rtol=1e-10, atol=1e-13)
    assert diag.abs().sum() > 0


@pytest.mark.parametrize("name", ["resnet", "token-transformer"])
def test_diagonal_with_output_hessians_equals_the_assembled_jacobian(
    name, route
) -> None:
    model, x = _case(name)
    params = list(model.parameters())
    parts = jacobian_factors(model, x, params)
    gen = torch.Generator().manual_seed(4)
    root = torch.randn(5, 3, 3, generator=gen, dtype=torch.float64)
    lam = root @ root.transpose(1, 2)
    J = parts.assembled(params)
    expected = torch.einsum("bvp,bvw,bwp->p", J, lam, J)
    got = _factor_products.factor_ggn_diagonal(parts, params, lam)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-13)
