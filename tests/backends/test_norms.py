"""LayerNorm and GroupNorm: Jacobians differentiable to every order.

PyTorch's fused ``layer_norm``/``group_norm`` kernels get the third derivative of
a network wrong (pytorch/pytorch#175754, torch 2.14; the ``torch.func`` reference
below fails the same check when the model calls them), so the engine redoes both
normalisations with elementary operations while it records the forward pass (and
``DiffFuncGGN`` runs them so inside its ``torch.func`` transforms).
Each check here compares against finite differences (``gradgradcheck``) or a
float64 ``torch.func`` reference.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN

BACKENDS = [DiffBackPackGGN, DiffFuncGGN]


class _Net(nn.Module):
    """Linear → norm → tanh → Linear on ``(B, T, 3)`` sequences (mean over T)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.norm = norm
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if isinstance(self.norm, nn.GroupNorm):
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        else:
            h = self.norm(h)
        return self.b(torch.tanh(h)).mean(1)


NORMS = {
    "layer_norm": lambda: nn.LayerNorm(4),
    "layer_norm_no_affine": lambda: nn.LayerNorm(4, elementwise_affine=False),
    "group_norm": lambda: nn.GroupNorm(2, 4),
}


def _setup(name: str) -> tuple[_Net, torch.Tensor]:
    torch.manual_seed(0)
    model = _Net(NORMS[name]()).double()
    with torch.no_grad():  # non-trivial affine parameters
        for p in model.norm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model, torch.randn(2, 5, 3, dtype=torch.float64)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("name", list(NORMS))
def test_second_derivative_of_jacobians_in_upstream_weight(name, backend_cls):
    model, x = _setup(name)
    backend = backend_cls(model, "classification")
    leaves = [model.a.weight, *model.norm.parameters()]

    def fn(*_):
        return backend.jacobians(x, enable_backprop=True)[0]

    torch.manual_seed(1)
    assert torch.autograd.gradgradcheck(fn, tuple(leaves), fast_mode=True)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("name", list(NORMS))
def test_second_derivative_of_jacobians_in_the_input(name, backend_cls):
    model, x = _setup(name)
    backend = backend_cls(model, "classification")
    x = x.requires_grad_(True)

    def fn(inp):
        return backend.jacobians(inp, enable_backprop=True)[0]

    assert torch.autograd.gradgradcheck(fn, (x,), fast_mode=True)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("name", list(NORMS))
def test_jacobians_match_torch_func(name, backend_cls):
    model, x = _setup(name)
    J, f = backend_cls(model, "classification").jacobians(x)
    params = dict(model.named_parameters())

    def one(p, xi):
        return torch.func.functional_call(model, p, (xi[None],))[0]

    ref = torch.func.vmap(torch.func.jacrev(one), in_dims=(None, 0))(params, x)
    ref = torch.cat([ref[k].flatten(2) for k in params], dim=2)
    torch.testing.assert_close(J, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f, model(x), rtol=1e-12, atol=1e-12)


def test_fused_layer_norm_third_derivative_is_wrong_upstream():
    """Why the rule exists: PyTorch's own ``vmap(jacrev)`` through ``nn.LayerNorm``.

    If this starts failing (PyTorch fixed its kernel), the elementary forward in
    ``jacobians/_rules_norm.py`` can go.
    """
    model, x = _setup("layer_norm_no_affine")
    x = x[:, 0]
    w = model.a.weight.detach().clone().requires_grad_(True)

    def fn(weight):
        params = {**dict(model.named_parameters()), "a.weight": weight}

        def one(xi):
            return torch.func.functional_call(model, params, (xi[None, None],))[0]

        return torch.func.vmap(torch.func.jacrev(one))(x)

    torch.manual_seed(1)
    assert not torch.autograd.gradgradcheck(
        fn, (w,), fast_mode=True, raise_exception=False
    )
