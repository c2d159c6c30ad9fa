"""Closed-form Conv1d rule: Jacobians, their gradients and gradcheck."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.jacobians import _derivatives
from tests.references import reference_jacobians


def _conv1d_model() -> nn.Module:
    torch.manual_seed(0)
    return (
        nn.Sequential(
            nn.Conv1d(2, 3, 3, stride=2, dilation=2, padding=1),
            nn.Tanh(),
            nn.Conv1d(3, 2, 2, padding=2, bias=False),
            nn.Flatten(),
            nn.Linear(2 * 8, 2),
        )
        .double()
        .eval()
    )


def _grads(scalar, leaves):
    """Gradients, zeros where a leaf does not influence ``scalar``."""
    grads = torch.autograd.grad(scalar, leaves, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, leaves)]


@pytest.fixture
def no_backpack_rule(monkeypatch):
    """Fail if any module falls back to BackPACK's generic derivative."""

    def refuse(*args, **kwargs):
        raise AssertionError("BackPACK's generic derivative was used")

    monkeypatch.setattr(_derivatives, "_backpack_blocks", refuse)


def test_conv1d_jacobians_and_gradients_match_torch_func(no_backpack_rule):
    model = _conv1d_model()
    x = torch.randn(3, 2, 11, dtype=torch.float64, requires_grad=True)
    backend = DiffBackPackGGN(model, "classification")
    J, _ = backend.jacobians(x, enable_backprop=True)
    J_ref, _ = reference_jacobians(model, x)
    torch.testing.assert_close(J, J_ref, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(J_ref)
    leaves = [*model.parameters(), x]
    grads = _grads((weights * J * J).sum(), leaves)
    grads_ref = _grads((weights * J_ref * J_ref).sum(), leaves)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-11)


def test_conv1d_gradcheck_and_gradgradcheck(no_backpack_rule):
    backend = DiffBackPackGGN(_conv1d_model(), "classification")
    x = torch.randn(2, 2, 11, dtype=torch.float64, requires_grad=True)

    def fn(x):
        return backend.jacobians(x, enable_backprop=True)

    assert torch.autograd.gradcheck(fn, (x,), fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, (x,), fast_mode=True)
