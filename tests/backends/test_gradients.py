"""Contract 1: results are graph-connected and their gradients are right."""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from tests.conftest import CASES, Case
from tests.references import loop_jacobians


def _objective(J: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """A smooth function of (J, f) that touches every entry, like an NTK objective."""
    K = torch.einsum("bcp,dep->bdce", J, J).flatten(0, 1)
    return (
        (K**2).sum().sqrt()
        + torch.logsumexp(J.flatten(), 0)
        + (f.sin() * J.sum(-1)).sum()
    )


def _inputs(case: Case, leaf: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (the tensor to differentiate w.r.t., the input fed to the model)."""
    z = case.inputs().requires_grad_(True)
    return z, (z if leaf else torch.sin(z) * 1.5)


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "nonleaf"])
def test_input_gradient_matches_autograd_loop(case, backend_cls, leaf):
    model = case.model()
    z, x = _inputs(case, leaf)
    J, f = backend_cls(model, "regression").jacobians(x, enable_backprop=True)
    (grad,) = torch.autograd.grad(_objective(J, f), z)

    z_ref, x_ref = _inputs(case, leaf)
    J_ref, f_ref = loop_jacobians(model, x_ref)
    (grad_ref,) = torch.autograd.grad(_objective(J_ref, f_ref), z_ref)

    torch.testing.assert_close(J, J_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f.reshape(f_ref.shape), f_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)


def test_parameter_gradient_matches_autograd_loop(case, backend_cls):
    model = case.model()
    x = case.inputs()
    params = list(model.parameters())
    J, f = backend_cls(model, "regression").jacobians(x, enable_backprop=True)
    grads = torch.autograd.grad(_objective(J, f), params)
    J_ref, f_ref = loop_jacobians(model, x)
    grads_ref = torch.autograd.grad(_objective(J_ref, f_ref), params)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=lambda c: c.name)
@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN])
def test_gradcheck_and_gradgradcheck(backend_cls, case):
    model = case.model()
    backend = backend_cls(model, "regression")

    def fn(x):
        J, f = backend.jacobians(x, enable_backprop=True)
        return J, f

    x = case.inputs(batch=2).requires_grad_(True)
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
def test_selected_output_jacobians_match_reference(backend_cls):
    case = CASES[1]
    model = case.model()
    x = case.inputs(batch=5).requires_grad_(True)
    outputs = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0], [1, 2]])
    J, f = backend_cls(model, "classification").selected_output_jacobians(
        x, outputs, enable_backprop=True
    )
    (grad,) = torch.autograd.grad((J**2).sum(), x)

    x_ref = case.inputs(batch=5).requires_grad_(True)
    J_all, _ = loop_jacobians(model, x_ref)
    J_ref = torch.stack([J_all[n, outputs[n]] for n in range(5)])
    (grad_ref,) = torch.autograd.grad((J_ref**2).sum(), x_ref)
    torch.testing.assert_close(J, J_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)


def test_enable_backprop_false_detaches(case, backend_cls):
    model = case.model()
    x = case.inputs().requires_grad_(True)
    J, f = backend_cls(model, "regression").jacobians(x, enable_backprop=False)
    assert not J.requires_grad and J.grad_fn is None
    assert not f.requires_grad and f.grad_fn is None
    J_ref, _ = loop_jacobians(model, x.detach())
    torch.testing.assert_close(J, J_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffBackPackEF])
def test_per_sample_gradients_match_reference(backend_cls):
    case = CASES[2]  # CNN
    model = case.model()
    x = case.inputs(batch=5)
    y = torch.tensor([0, 2, 1, 1, 0])
    Gs, loss = backend_cls(model, "classification").gradients(x, y)
    J_ref, f_ref = loop_jacobians(model, x)
    residual = torch.softmax(f_ref, -1) - torch.nn.functional.one_hot(y, 3)
    G_ref = torch.einsum("bc,bcp->bp", residual, J_ref)
    torch.testing.assert_close(Gs, G_ref, rtol=1e-10, atol=1e-12)
    loss_ref = torch.nn.functional.cross_entropy(f_ref, y, reduction="sum")
    torch.testing.assert_close(loss, loss_ref)
