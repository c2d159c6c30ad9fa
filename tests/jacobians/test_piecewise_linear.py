"""Piecewise-linear activations as selections: the same Jacobians and derivatives,
and signals whose graph does not reach the input (``_piecewise_linear``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.jacobians._piecewise_linear import PIECEWISE_LINEAR_FORWARDS
from tests.references import loop_jacobians

ACTIVATIONS = {
    "relu": lambda: nn.ReLU(),
    "relu-inplace": lambda: nn.ReLU(inplace=True),
    "leaky-relu": lambda: nn.LeakyReLU(0.1),
    "hardtanh": lambda: nn.Hardtanh(-0.5, 0.7),
    "relu6": lambda: nn.ReLU6(),
}


POOLS = {
    "max-pool-1d": (lambda: nn.MaxPool1d(3, stride=2, padding=1), (2, 3, 11)),
    "max-pool-2d": (lambda: nn.MaxPool2d(2), (2, 3, 6, 6)),
    "max-pool-2d-dilated": (
        lambda: nn.MaxPool2d(3, stride=1, padding=1, dilation=2, ceil_mode=True),
        (3, 7, 7),  # unbatched
    ),
    "max-pool-3d": (lambda: nn.MaxPool3d(2, stride=(1, 2, 2)), (1, 2, 4, 5, 5)),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_max_pool_gather_equals_the_module_and_its_gradient(name: str) -> None:
    build, shape = POOLS[name]
    module = build()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    forward = PIECEWISE_LINEAR_FORWARDS[type(module)]
    _, gathered = forward(module, (x,), {})
    expected = module(x)
    assert torch.equal(gathered, expected)
    seed = torch.randn_like(expected)
    (d_gathered,) = torch.autograd.grad(gathered, x, seed)
    (d_expected,) = torch.autograd.grad(expected, x, seed)
    assert torch.equal(d_gathered, d_expected)


def test_max_pool_with_indices_is_left_to_the_module() -> None:
    module = nn.MaxPool2d(2, return_indices=True)
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    _, pair = PIECEWISE_LINEAR_FORWARDS[nn.MaxPool2d](module, (x,), {})
    expected = module(x)
    assert torch.equal(pair[0], expected[0]) and torch.equal(pair[1], expected[1])


def test_a_pooling_cnn_has_input_free_signals_and_the_loop_jacobians() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).double()
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64, requires_grad=True)
    backend = DiffBackPackGGN(model, "classification")
    factors = backend.jacobian_factors(x, enable_backprop=True)
    signals = [e.g for entries in factors.factors.values() for e in entries]
    total = sum(g.sum() for g in signals if g.requires_grad)
    assert torch.autograd.grad(total, x, allow_unused=True) == (None,)
    _assert_loop_jacobians(backend, model, x)


def _assert_loop_jacobians(
    backend: DiffBackPackGGN, model: nn.Module, x: torch.Tensor
) -> None:
    """The Jacobians and the gradient in ``x`` of a weighted sum of them equal
    the float64 per-sample autograd loop's."""
    Js, _ = backend.jacobians(x, enable_backprop=True)
    ref, _ = loop_jacobians(model, x)
    torch.testing.assert_close(Js, ref, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(ref)
    (grad,) = torch.autograd.grad((Js * weights).sum(), x)
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), x)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)


def _net(activation: str) -> nn.Module:
    torch.manual_seed(0)
    act = ACTIVATIONS[activation]
    return nn.Sequential(
        nn.Linear(3, 16), act(), nn.Linear(16, 16), act(), nn.Linear(16, 2)
    ).double()


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_selection_equals_the_module_and_its_derivative(activation: str) -> None:
    module = ACTIVATIONS[activation]()
    x = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    x = x[(x - x.round()).abs() > 1e-3]  # away from every kink (0, ±0.5, 0.7, 6)
    x = x[(x - 0.7).abs() > 1e-3].requires_grad_()
    forward = PIECEWISE_LINEAR_FORWARDS[type(module)]
    _, selected = forward(module, (x,), {})
    expected = module(x.clone())
    assert torch.equal(selected, expected)
    (d_selected,) = torch.autograd.grad(selected.sum(), x)
    (d_expected,) = torch.autograd.grad(module(x.clone()).sum(), x)
    assert torch.equal(d_selected, d_expected)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_jacobians_and_their_input_gradient_equal_the_autograd_loop(
    activation: str,
) -> None:
    model = _net(activation)
    torch.manual_seed(1)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    _assert_loop_jacobians(DiffBackPackGGN(model, "regression"), model, x)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_signals_are_constants_of_the_input(activation: str) -> None:
    """The Gram's gradient in x flows through the layer inputs alone: no path
    from any signal back to x, while the parameters still reach them."""
    model = _net(activation)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    factors = DiffBackPackGGN(model, "regression").jacobian_factors(
        x, enable_backprop=True
    )
    signals = [e.g for entries in factors.factors.values() for e in entries]
    hidden = [g for g in signals if g.requires_grad]
    assert hidden  # the two hidden layers' signals depend on the weights
    total = sum(g.sum() for g in hidden)
    assert torch.autograd.grad(total, x, allow_unused=True) == (None,)
    weight = model[2].weight  # the signals at the first layer pass through it
    (through_weight,) = torch.autograd.grad(total, weight, allow_unused=True)
    assert through_weight is not None


def test_rewritten_only_where_the_graph_is_kept() -> None:
    """Without the Jacobians' graph the selection saves nothing: the curvature's
    passes run the activations' own kernels."""
    from laplace_diffjac.jacobians._elementary import rewritten_modules

    model = _net("relu")
    kept = rewritten_modules(model, [], graph=True)
    assert [type(m) for m in kept] == [nn.ReLU, nn.ReLU]
    assert rewritten_modules(model, [], graph=False) == []
