"""``structured_ntk`` against the Gram of float64 reference Jacobians."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac.kernels._structured import structured_ntk, supports_structured_ntk
from tests.references import reference_jacobians


def _chain(*acts: nn.Module, c: int = 3, bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Flatten()]
    fan_in = 4
    for act in acts:
        layers += [nn.Linear(fan_in, 5, bias=bias), act]
        fan_in = 5
    layers.append(nn.Linear(fan_in, c))
    return nn.Sequential(*layers).double().eval()


MODELS = {
    "tanh-sigmoid": lambda: _chain(nn.Tanh(), nn.Sigmoid()),
    "relu-gelu": lambda: _chain(nn.ReLU(), nn.GELU()),
    "gelu-tanh-approx": lambda: _chain(nn.GELU(approximate="tanh")),
    "silu-softplus": lambda: _chain(nn.SiLU(), nn.Softplus(beta=2.0, threshold=1.0)),
    "elu-leaky": lambda: _chain(nn.ELU(alpha=0.7), nn.LeakyReLU(0.2)),
    "inplace-relu-nobias": lambda: _chain(nn.ReLU(inplace=True), bias=False),
    "identity-dropout-C1": lambda: (
        nn.Sequential(
            nn.Linear(4, 6), nn.Identity(), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 1)
        )
        .double()
        .eval()
    ),
    "nested-ends-in-act": lambda: nn.Sequential(
        nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 2), nn.Sigmoid()
    ).double(),
    "single-linear": lambda: nn.Sequential(nn.Linear(4, 3)).double(),
}


def _inputs(batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, generator=gen, dtype=torch.float64)


def _reference_gram(model, x1, x2, precision=1.0):
    J1, _ = reference_jacobians(model, x1)
    J2, _ = reference_jacobians(model, x2)
    return torch.einsum("bcp,dep->bdce", J1, J2) / precision


@pytest.mark.parametrize("name", list(MODELS))
def test_equals_reference_gram(name: str) -> None:
    model = MODELS[name]()
    x1, x2 = _inputs(5, 1), _inputs(3, 2)
    assert supports_structured_ntk(model, list(model.parameters()))
    K = structured_ntk(model, x1, x2, prior_precision=2.5)
    ref = _reference_gram(model, x1, x2, 2.5)
    assert K.shape == ref.shape
    torch.testing.assert_close(K, ref, rtol=1e-10, atol=1e-12)
    K_sym = structured_ntk(model, x1)
    torch.testing.assert_close(K_sym, _reference_gram(model, x1, x1))


def test_frozen_parameters_are_left_out() -> None:
    model = _chain(nn.Tanh())
    model[1].weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    assert supports_structured_ntk(model, params)
    assert not supports_structured_ntk(model, list(model.parameters()))
    x = _inputs(4, 3)
    J, _ = reference_jacobians(model, x, params)
    ref = torch.einsum("bcp,dep->bdce", J, J)
    torch.testing.assert_close(structured_ntk(model, x), ref)


def test_tensor_prior_precision_and_parameter_gradient() -> None:
    model = _chain(nn.Tanh())
    x = _inputs(3, 4)
    prec = torch.tensor(3.0, dtype=torch.float64)
    K = structured_ntk(model, x, prior_precision=prec)
    torch.testing.assert_close(K, _reference_gram(model, x, x, 3.0))
    weight = model[1].weight
    (g,) = torch.autograd.grad(K.square().sum(), weight)
    (g_ref,) = torch.autograd.grad(
        _reference_gram(model, x, x).square().sum() / 9, weight
    )
    torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize(
    "name", ["tanh-sigmoid", "silu-softplus", "nested-ends-in-act"]
)
def test_gradcheck_in_both_inputs(name: str) -> None:
    model = MODELS[name]()
    x1 = _inputs(3, 5).requires_grad_(True)
    x2 = _inputs(2, 6).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: structured_ntk(model, a, b), (x1, x2))
    assert torch.autograd.gradcheck(lambda a: structured_ntk(model, a), (x1,))
    assert torch.autograd.gradgradcheck(lambda a: structured_ntk(model, a), (x1,))


UNSUPPORTED = {
    "not-sequential": lambda: nn.Linear(4, 3),
    "conv": lambda: nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(4, 2)),
    "layernorm": lambda: nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)),
    "softmax": lambda: nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1)),
    "prelu": lambda: nn.Sequential(nn.Linear(4, 3), nn.PReLU()),
    "train-dropout": lambda: nn.Sequential(nn.Linear(4, 3), nn.Dropout()).train(),
    "partial-flatten": lambda: nn.Sequential(nn.Flatten(2), nn.Linear(4, 3)),
    "empty": lambda: nn.Sequential(),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_models(name: str) -> None:
    model = UNSUPPORTED[name]()
    assert not supports_structured_ntk(model, list(model.parameters()))
    with pytest.raises(ValueError):
        structured_ntk(model, torch.randn(2, 1, 4))


def test_bad_shapes_and_prior() -> None:
    model = _chain(nn.Tanh())
    with pytest.raises(ValueError):
        structured_ntk(model, _inputs(2, 1), prior_precision=torch.ones(3))
    no_flatten = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="Flatten"):
        structured_ntk(no_flatten, torch.randn(2, 5, 4))


def test_no_side_effects_and_no_warnings(recwarn: pytest.WarningsRecorder) -> None:
    from tests.references import assert_same_state, model_state

    model = _chain(nn.ReLU(inplace=True))
    before = model_state(model)
    x = _inputs(3, 7).requires_grad_(True)
    torch.autograd.grad(structured_ntk(model, x).sum(), x)
    assert_same_state(before, model_state(model))
    assert not recwarn.list


def _flat_reference(model, x1, x2, params=None):
    J1, _ = reference_jacobians(model, x1, params)
    J2, _ = reference_jacobians(model, x2, params)
    return torch.einsum("acp,bep->acbe", J1, J2).reshape(J1.shape[0] * J1.shape[1], -1)


@pytest.mark.parametrize("name", list(MODELS))
def test_features_give_the_gram_and_its_diagonal(name: str) -> None:
    from laplace_diffjac.kernels._structured import structured_features
    from laplace_diffjac.kernels._structured_features import (
        NTKFeatures,
        feature_diag,
        feature_gram,
    )

    model = MODELS[name]()
    x1, x2 = _inputs(5, 1), _inputs(3, 2)
    f1, f2 = structured_features(model, x1), structured_features(model, x2)
    ref = _flat_reference(model, x1, x2)
    torch.testing.assert_close(
        feature_gram(f1, f2, 0.4), 0.4 * ref, rtol=1e-10, atol=1e-12
    )
    J1, _ = reference_jacobians(model, x1)
    diag = torch.einsum("bcp,bep->bce", J1, J1)
    torch.testing.assert_close(feature_diag(f1, 2.0), 2 * diag, rtol=1e-10, atol=1e-12)
    # subsets and concatenation of features are the features of subsets
    both = NTKFeatures.cat([f1[torch.tensor([0, 2])], f2[1:]])
    x12 = torch.cat([x1[[0, 2]], x2[1:]])
    torch.testing.assert_close(
        feature_gram(both, both),
        _flat_reference(model, x12, x12),
        rtol=1e-10,
        atol=1e-12,
    )


def test_features_with_frozen_weight_or_bias() -> None:
    from laplace_diffjac.kernels._structured import structured_features
    from laplace_diffjac.kernels._structured_features import feature_diag, feature_gram

    model = _chain(nn.Tanh(), nn.Sigmoid())
    model[1].weight.requires_grad_(False)  # bias only in the first layer
    model[5].bias.requires_grad_(False)  # weight only in the last layer
    params = [p for p in model.parameters() if p.requires_grad]
    x1, x2 = _inputs(4, 3), _inputs(2, 4)
    f1, f2 = structured_features(model, x1), structured_features(model, x2)
    torch.testing.assert_close(
        feature_gram(f1, f2),
        _flat_reference(model, x1, x2, params),
        rtol=1e-10,
        atol=1e-12,
    )
    J1, _ = reference_jacobians(model, x1, params)
    torch.testing.assert_close(
        feature_diag(f1), torch.einsum("bcp,bep->bce", J1, J1), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize(
    "name", ["tanh-sigmoid", "identity-dropout-C1", "single-linear"]
)
def test_symmetric_gram_value_and_gradient(name: str) -> None:
    """Equal to the reference Gram; gradient equal to autograd's for a symmetric
    consumer (a symmetric weighting), gradcheck in the inputs."""
    from laplace_diffjac.kernels._structured import structured_features
    from laplace_diffjac.kernels._symmetric_gram import symmetric_feature_gram

    model = MODELS[name]()
    x = _inputs(4, 8).requires_grad_(True)
    K = symmetric_feature_gram(structured_features(model, x), 0.7)
    ref = 0.7 * _flat_reference(model, x, x)
    torch.testing.assert_close(K, ref, rtol=1e-10, atol=1e-12)
    W = torch.randn(*K.shape, generator=torch.Generator().manual_seed(3)).double()
    W = W + W.T
    (g,) = torch.autograd.grad((K * W).sum(), x)
    (g_ref,) = torch.autograd.grad((ref * W).sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-11)
    weights = list(model.parameters())
    gw = torch.autograd.grad(
        (symmetric_feature_gram(structured_features(model, x)) * W).sum(),
        weights,
        allow_unused=True,
    )
    gw_ref = torch.autograd.grad(
        (_flat_reference(model, x, x) * W).sum(), weights, allow_unused=True
    )
    for a, b, p in zip(gw, gw_ref, weights):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
