"""``DiffFuncGGN.kron`` (curvlinops' KFAC) equals ``DiffBackPackGGN.kron`` (BackPACK's
KFLR) factor by factor, for full and last-layer curvature, and drives ``KronLaplace``
end to end."""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import Laplace
from laplace.curvature import BackPackGGN
from laplace.utils import FeatureExtractor
from torch import nn

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.errors import InvalidInputError, UnsupportedModuleError
from tests.conftest import CASES
from tests.laplace_integration.helpers import (
    assert_close,
    assert_same_predictive,
    train_loader,
    upstream_quiet,
)
from tests.references import assert_same_state, model_state

KRON_CASES = [c for c in CASES if c.name in ("mlp-C3", "cnn-C3")]
cases = pytest.mark.parametrize("case", KRON_CASES, ids=lambda c: c.name)
likelihoods = pytest.mark.parametrize("likelihood", ["regression", "classification"])


@pytest.fixture(autouse=True)
def _float64_default():
    """BackPACK's AvgPool2d derivative builds its helper conv in the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _targets(likelihood: str, n: int, c: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    if likelihood == "regression":
        return torch.randn(n, c, generator=gen, dtype=torch.float64)
    return torch.randint(0, c, (n,), generator=gen)


@likelihoods
@pytest.mark.parametrize("stochastic", [False, True])
@cases
def test_kron_equals_backpack(case, likelihood, stochastic):
    model, x = case.model(), case.inputs(6)
    y = _targets(likelihood, 6, case.n_outputs)
    before = model_state(model)
    loss, kron = DiffFuncGGN(model, likelihood, stochastic=stochastic).kron(x, y, 20)
    assert_same_state(before, model_state(model))
    if stochastic:  # MC labels differ from BackPACK's; layout and scale agree
        ref = DiffBackPackGGN(model, likelihood, stochastic=False).kron(x, y, 20)[1]
        assert [[f.shape for f in b] for b in kron.kfacs] == [
            [f.shape for f in b] for b in ref.kfacs
        ]
        return
    loss_ref, kron_ref = DiffBackPackGGN(model, likelihood).kron(x, y, 20)
    assert_close(kron, kron_ref, "kron factors")
    assert_close(loss, loss_ref, "loss")
    with upstream_quiet():
        loss_up, kron_up = BackPackGGN(copy.deepcopy(model), likelihood).kron(x, y, 20)
    assert_close(kron, kron_up, "kron factors vs laplace-torch BackPackGGN")


@likelihoods
@cases
def test_last_layer_kron_equals_backpack(case, likelihood):
    x = case.inputs(6)
    y = _targets(likelihood, 6, case.n_outputs)
    features = [FeatureExtractor(case.model(), last_layer_name=None) for _ in "ab"]
    for extractor in features:
        extractor.find_last_layer(x)
    ours = DiffFuncGGN(features[0], likelihood, last_layer=True).kron(x, y, 20)
    ref = DiffBackPackGGN(features[1], likelihood, last_layer=True).kron(x, y, 20)
    assert len(ours[1].kfacs) == 2
    assert_close(ours[1], ref[1], "last-layer kron factors")
    assert_close(ours[0], ref[0], "loss")


@likelihoods
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_kron_laplace_end_to_end(likelihood, subset):
    case = KRON_CASES[0]
    model = case.model()
    loader = train_loader(likelihood, n_outputs=case.n_outputs)
    fits = {}
    for backend in (DiffFuncGGN, DiffBackPackGGN):
        la = Laplace(copy.deepcopy(model), likelihood, subset, "kron", backend=backend)
        la.fit(loader)
        fits[backend] = la
    ours, ref = fits[DiffFuncGGN], fits[DiffBackPackGGN]
    assert_close(ours.H_facs, ref.H_facs, "kron factors")
    assert_close(ours.log_marginal_likelihood(), ref.log_marginal_likelihood())
    assert_same_predictive(ours, ref)


def test_kron_unsupported_module_is_named():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(UnsupportedModuleError, match=r"1 \(LayerNorm\)"):
        DiffFuncGGN(model, "regression").kron(x, torch.randn(5, 2), 5)
    model[1].requires_grad_(False)  # frozen: no factor needed
    _, kron = DiffFuncGGN(model, "regression").kron(
        x, torch.randn(5, 2, dtype=torch.float64), 5
    )
    assert len(kron.kfacs) == 4


def test_kron_refuses_subnetwork_and_bad_input():
    model = KRON_CASES[0].model()
    backend = DiffFuncGGN(model, "regression", subnetwork_indices=torch.arange(3))
    with pytest.raises(UnsupportedModuleError, match="subnetwork"):
        backend.kron(torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3), 2)
    with pytest.raises(InvalidInputError):
        DiffFuncGGN(model, "regression").kron(
            torch.randn(2, 3, dtype=torch.float32), torch.randn(2, 3), 2
        )
