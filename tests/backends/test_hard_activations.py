"""MobileNetV3's activations: Hardsigmoid in elementary form, Hardswish in place.

The block itself (squeeze-excitation gate, ``Hardswish(inplace=True)``, the residual
``+=``) is audited (``audit_cases``: ``InvertedResidual-SE-hardswish``); here the
elementary form on its own, and an in-place ``Hardsigmoid``, whose input the
engine must keep before the module overwrites it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.jacobians._elementary import recorded_hardsigmoid
from tests.references import (
    assert_same_state,
    central_difference,
    loop_jacobians,
    model_state,
)


def _elementary(x: torch.Tensor) -> torch.Tensor:
    return recorded_hardsigmoid(nn.Hardsigmoid(), (x,), {})[1]


def test_elementary_hardsigmoid_has_pytorchs_values_and_kinks():
    x = torch.cat([torch.linspace(-5, 5, 101), torch.tensor([-3.0, 3.0])])
    x = x.double().requires_grad_(True)
    torch.testing.assert_close(
        _elementary(x), nn.functional.hardsigmoid(x), rtol=0, atol=2e-16
    )
    (g,) = torch.autograd.grad(_elementary(x).sum(), x)
    (g_ref,) = torch.autograd.grad(nn.functional.hardsigmoid(x).sum(), x)
    # PyTorch's kernel: float32's 1/6 inside (-3, 3) (pinned upstream), 0 elsewhere
    torch.testing.assert_close(g, g_ref, rtol=1e-7, atol=0)
    assert g[-2:].tolist() == [0.0, 0.0] == g_ref[-2:].tolist()


def test_elementary_hardsigmoid_differentiates_twice():
    x = torch.tensor([-4.0, -2.5, 0.3, 2.9, 3.5], dtype=torch.float64)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(_elementary, (x,))
    assert torch.autograd.gradgradcheck(_elementary, (x,))


def _gated(inplace: bool) -> nn.Module:
    """A squeeze-excitation-like gate: ``x * hardsigmoid(W x)``, then a head."""

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = nn.Hardsigmoid(inplace=inplace)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x * self.scale(self.fc(x)))

    torch.manual_seed(0)
    return Gate().double()


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
def test_in_place_hardsigmoid_gives_right_graph_connected_jacobians(backend_cls):
    model, plain = _gated(inplace=True), _gated(inplace=False)
    x = 2 * torch.randn(5, 4, dtype=torch.float64)
    before = model_state(model)
    x_in = x.clone().requires_grad_(True)
    J, f = backend_cls(model, "regression").jacobians(x_in, enable_backprop=True)
    assert_same_state(before, model_state(model))
    J_ref, f_ref = loop_jacobians(plain, x)
    torch.testing.assert_close(J, J_ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f, f_ref.detach(), rtol=1e-10, atol=1e-12)
    (g,) = torch.autograd.grad(J.square().sum(), x_in)
    u = torch.randn_like(x)
    expected = central_difference(
        lambda t: loop_jacobians(copy.deepcopy(plain), x + t * u)[0].square().sum()
    )
    torch.testing.assert_close((g * u).sum(), expected, rtol=1e-6, atol=1e-8)
