"""PyTorch bugs the backends work around, pinned so that their fixes are noticed.

Each test asserts what PyTorch *should* do and is a strict ``xfail``: when an
upstream fix makes one pass, the workaround it names can go.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.nn.utils.parametrizations import weight_norm

from tests.references import central_difference, loop_jacobians


def _vmap_jacrev(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = dict(model.named_parameters())

    def single(p, xi):
        return functional_call(model, p, (xi[None],)).reshape(-1)

    jac = vmap(jacrev(single), in_dims=(None, 0))(params, x)
    return torch.cat([j.flatten(start_dim=2) for j in jac.values()], dim=2)


def _prelu_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 2)).double()


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="prelu's backward batching rule fails under nested vmap when B != C "
    "(worked around in laplace_diffjac/jacobians/_rules_prelu.py)",
)
def test_prelu_vmap_jacrev_runs_when_batch_differs_from_outputs():
    model = _prelu_mlp()
    x = torch.randn(5, 3, dtype=torch.float64)
    _vmap_jacrev(model, x)


@pytest.mark.xfail(
    strict=True,
    reason="prelu's backward batching rule mixes samples and outputs when B == C "
    "(worked around in laplace_diffjac/jacobians/_rules_prelu.py)",
)
def test_prelu_vmap_jacrev_is_right_when_batch_equals_outputs():
    model = _prelu_mlp()
    x = torch.randn(2, 3, dtype=torch.float64)
    expected, _ = loop_jacobians(model, x)
    torch.testing.assert_close(_vmap_jacrev(model, x), expected.detach())


def _gradient_check(model: nn.Module, x: torch.Tensor, jacobians) -> None:
    """d/dt of ``Σ J²`` along a direction of the parameters and (floating) input:
    autograd against central differences of the loop's Jacobians."""
    torch.manual_seed(2)
    direction = [torch.randn_like(p) for p in model.parameters()]
    floating = x.is_floating_point()
    u = torch.randn_like(x) if floating else None
    x_in = x.clone().requires_grad_(True) if floating else x
    leaves = list(model.parameters()) + ([x_in] if floating else [])
    J = jacobians(model, x_in)
    grads = torch.autograd.grad(J.square().sum(), leaves, allow_unused=True)
    along = sum(
        (g * d).sum()
        for g, d in zip(grads, direction + ([u] if floating else []))
        if g is not None
    )

    def at(t):
        moved = copy.deepcopy(model)
        with torch.no_grad():
            for p, d in zip(moved.parameters(), direction):
                p.add_(t * d)
        shifted = x + t * u if floating else x
        return loop_jacobians(moved, shifted)[0].square().sum()

    torch.testing.assert_close(along, central_difference(at), rtol=1e-6, atol=1e-8)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="the gradient through vmap(jacrev) of the fused instance_norm is wrong "
    "(worked around in laplace_diffjac/jacobians/_rules_norm.py)",
)
def test_instance_norm_jacobians_differentiate_rightly():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.InstanceNorm1d(2, affine=True), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3)
    ).double()
    x = torch.randn(5, 2, 6, dtype=torch.float64)
    _gradient_check(model, x, _vmap_jacrev)


@pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the "
    "batching rule for aten.._weight_norm:UserWarning"
)
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="the gradient through vmap(jacrev) of weight_norm's fused kernel is "
    "wrong (worked around in laplace_diffjac/jacobians/_elementary.py)",
)
def test_weight_norm_jacobians_differentiate_rightly():
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3))
    model = model.double()
    x = torch.randn(5, 4, dtype=torch.float64)
    _gradient_check(model, x, _vmap_jacrev)


@pytest.mark.xfail(
    strict=True,
    raises=NotImplementedError,
    reason="_embedding_bag_backward has no derivative "
    "(worked around in laplace_diffjac/jacobians/_elementary.py)",
)
def test_embedding_bag_jacobians_differentiate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(7, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randint(0, 7, (5, 3))
    _gradient_check(model, x, lambda m, x: loop_jacobians(m, x)[0])


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="hardsigmoid_backward has no derivative "
    "(worked around in laplace_diffjac/jacobians/_elementary.py)",
)
def test_hardsigmoid_differentiates_twice():
    x = torch.linspace(-4, 4, 7, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradgradcheck(torch.nn.functional.hardsigmoid, (x,))


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="hardsigmoid's derivative in float64 is float32's 1/6, 3e-8 off "
    "(laplace_diffjac/jacobians/_elementary.py and tests/references.py use 1/6)",
)
def test_hardsigmoid_derivative_is_one_sixth_in_float64():
    x = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(torch.nn.functional.hardsigmoid(x).sum(), x)
    torch.testing.assert_close(g, torch.full_like(g, 1 / 6), rtol=1e-14, atol=0)
