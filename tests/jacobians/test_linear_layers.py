"""``jacobian_pieces``: Linear layers' inputs and signals, checked against a loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac.jacobians._engine import JacobianFactors, jacobian_pieces
from laplace_diffjac.jacobians._linear_layers import LinearSignals
from tests.references import loop_jacobians


class _TwoPaths(nn.Module):
    """Linear layers outside any Sequential, the last followed by an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(3, 5), nn.Linear(5, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.second(torch.tanh(self.first(x))))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _gram(layers: LinearSignals) -> torch.Tensor:
    """``J Jᵀ`` ``(B, V, B, V)`` written out from the layers, layer by layer."""
    total = 0
    for a, g, weight, bias in zip(
        layers.inputs, layers.signals, layers.weight, layers.bias
    ):
        scale = a @ a.T if weight else a.new_zeros(len(a), len(a))
        scale = scale + 1.0 if bias else scale
        total = total + scale[:, None, :, None] * torch.einsum("bvo,dwo->bvdw", g, g)
    return total


@pytest.mark.parametrize(
    ("build", "frozen"),
    [(_mlp, ()), (_TwoPaths, ()), (_mlp, ("0.weight",)), (_mlp, ("2.bias",))],
    ids=["sequential", "class", "bias-only-layer", "weight-only-layer"],
)
def test_the_layers_give_the_ntk_of_a_per_sample_loop(build, frozen) -> None:
    torch.manual_seed(0)
    model = build().double()
    params = [p for n, p in model.named_parameters() if n not in frozen]
    x = torch.randn(4, 3, dtype=torch.float64)
    layers = jacobian_pieces(model, x, params)
    assert isinstance(layers, LinearSignals)
    J, f = loop_jacobians(model, x, params)
    torch.testing.assert_close(layers.f, f)
    expected = torch.einsum("bvp,dwp->bvdw", J, J)
    torch.testing.assert_close(_gram(layers), expected, rtol=1e-12, atol=1e-12)


def test_the_layers_follow_the_parameters_order_and_are_detached() -> None:
    torch.manual_seed(0)
    model = _mlp().double()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    params = list(model.parameters())
    layers = jacobian_pieces(model, x, params[2:] + params[:2])
    assert isinstance(layers, LinearSignals)
    assert [a.shape[1] for a in layers.inputs] == [5, 3]
    tensors = [*layers.inputs, *layers.signals, layers.f]
    assert not any(t.requires_grad for t in tensors)
    graph = jacobian_pieces(model, x, params, enable_backprop=True)
    assert isinstance(graph, LinearSignals)
    torch.autograd.grad(_gram(graph).sum(), x)  # connected to x


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(8, 1)),
        nn.Sequential(nn.Linear(3, 3), nn.Tanh()),
    ],
    ids=["conv", "tokens"],
)
def test_other_modules_and_linear_layers_over_tokens_take_the_factors(model) -> None:
    x = (
        torch.randn(2, 1, 6)
        if isinstance(model[0], nn.Conv1d)
        else torch.randn(2, 4, 3)
    )
    if not isinstance(model[0], nn.Conv1d):
        model = nn.Sequential(model, nn.Flatten(), nn.Linear(12, 1))
    pieces = jacobian_pieces(model, x, list(model.parameters()))
    assert isinstance(pieces, JacobianFactors)


def test_a_weight_shared_by_two_layers_takes_the_factors() -> None:
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), second)
    params = list(dict.fromkeys(model.parameters()))
    pieces = jacobian_pieces(model, torch.randn(2, 3), params)
    assert isinstance(pieces, JacobianFactors)


def test_only_a_layer_whose_output_is_the_models_has_identity_signals() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    model = _mlp()
    last = jacobian_pieces(model, x, list(model.parameters()))
    assert isinstance(last, LinearSignals) and last.identity == (False, True)
    eye = torch.eye(2).expand(4, 2, 2)
    torch.testing.assert_close(last.signals[1], eye, rtol=0, atol=0)
    model = _TwoPaths()
    inner = jacobian_pieces(model, x, list(model.parameters()))
    assert isinstance(inner, LinearSignals) and inner.identity == (False, False)
