"""``ntk`` and ``ntk_diag`` within a memory budget that forces chunks.

The budget changes memory and time, nothing else: under a budget small enough
that every chunk holds one or two inputs, the Gram, its diagonal and their
gradients with respect to both inputs, the parameters and the prior precision
equal those of a float64 per-sample autograd loop (``tests.references``), which
shares no code with the package. The graph a budgeted Gram keeps for its
gradient is counted on the graph itself and stays within the budget.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN, ntk, ntk_diag
from laplace_diffjac.budget import memory_budget
from laplace_diffjac.errors import MemoryBudgetError
from laplace_diffjac.kernels._budgeted import (
    chunk_needs,
    plan_diagonal,
    plan_gram,
    probe,
)
from laplace_diffjac.kernels._held_memory import held_bytes
from laplace_diffjac.kernels._ntk import _budget_route, factor_route_applies
from tests.class_models import DictModel
from tests.references import assert_same_state, loop_jacobians, model_state

#: Bytes: a few inputs' features of the small models below, so every call chunks.
TINY = 12_000


def _smallest_budget(backend, x, sizes, symmetric, prior_var, grad=True):
    """The smallest budget (within 25 %) at which ``ntk`` and ``ntk_diag`` of
    ``x`` run, and the Gram's plan there: one or two inputs per chunk."""
    route = _budget_route(
        backend, factor_route_applies(backend), None, prior_var=prior_var
    )
    costs = probe(route, x, prior_var)
    budget = 256
    while True:
        try:
            scale = route.backward_scale
            plan = plan_gram(costs, sizes, symmetric, grad, budget, 256, scale)
            plan_diagonal(costs, sizes[0], grad, budget, 256, scale)
        except MemoryBudgetError:
            budget = int(budget * 1.25)
            continue
        return budget, plan


def _reference(model, x1, x2, prior_var):
    """``K`` and its diagonal from a per-sample autograd loop, differentiable."""
    J1, _ = loop_jacobians(model, x1)
    J2, _ = loop_jacobians(model, x2)
    var = prior_var.expand(J1.shape[-1])
    K = torch.einsum("acp,p,bep->abce", J1, var, J2)
    D = torch.einsum("acp,p,aep->ace", J1, var, J1)
    return K, D


def _functional(K, D):
    """A fixed random linear functional of ``K`` and ``D``."""
    gen = torch.Generator().manual_seed(7)
    wK = torch.randn(K.shape, generator=gen, dtype=K.dtype)
    wD = torch.randn(D.shape, generator=gen, dtype=D.dtype)
    return (wK * K).sum() + (wD * D).sum()


def _grads(loss, inputs):
    got = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, got)]


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "cross"])
@pytest.mark.parametrize("per_parameter", [False, True], ids=["scalar", "vector"])
def test_budgeted_gram_and_gradients_equal_the_reference(
    case, backend_cls, symmetric, per_parameter
):
    model = case.model()
    x1 = case.inputs(5, seed=1).requires_grad_()
    x2 = x1 if symmetric else case.inputs(4, seed=2).requires_grad_()
    P = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(3)
    prec = (
        (0.5 + torch.rand(P, generator=gen, dtype=torch.float64))
        if per_parameter
        else torch.tensor(1.7, dtype=torch.float64)
    ).requires_grad_()
    backend = backend_cls(model, "regression")
    sizes = (5, 5 if symmetric else 4)
    budget, plan = _smallest_budget(backend, x1, sizes, symmetric, 1 / prec.detach())
    assert plan.chunked and plan.chunk <= 2
    before = model_state(model)
    with memory_budget(budget):
        K = ntk(backend, x1, None if symmetric else x2, prior_precision=prec)
        D = ntk_diag(backend, x1, prior_precision=prec)
    assert_same_state(before, model_state(model))
    K_ref, D_ref = _reference(model, x1, x2, 1 / prec)
    torch.testing.assert_close(K, K_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(D, D_ref, rtol=1e-10, atol=1e-12)
    inputs = [x1, prec, *model.parameters()] + ([] if symmetric else [x2])
    got = _grads(_functional(K, D), inputs)
    expected = _grads(_functional(K_ref, D_ref), inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in model.parameters()) and x1.grad is None


def test_a_plan_takes_the_largest_chunk_that_fits(case, backend_cls):
    model = case.model()
    x = case.inputs(5).requires_grad_()
    backend = backend_cls(model, "regression")
    one = torch.tensor(1.0, dtype=torch.float64)
    route = _budget_route(backend, factor_route_applies(backend), None)
    costs = probe(route, x, one)
    assert costs.features > 0 and costs.graph > costs.features
    scale = route.backward_scale
    whole = plan_gram(costs, (5, 5), True, True, 2**30, 256, scale)
    assert not whole.chunked
    smallest, _ = _smallest_budget(backend, x, (5, 5), True, one)
    assert smallest < whole.needs
    for budget in (smallest, (smallest + int(whole.needs)) // 2):
        plan = plan_gram(costs, (5, 5), True, True, budget, 256, scale)
        if not plan.chunked:
            continue
        assert 1 <= plan.chunk < 5 and plan.needs <= budget
        # one more input per chunk would not fit
        more = chunk_needs(
            costs, (5, 5), True, plan.chunk + 1, plan.cache_columns, scale
        )
        assert more > budget


def test_the_graph_a_budgeted_gram_keeps_fits_the_budget():
    """Counted on the graph: unbudgeted, ``K`` keeps every chunk's features and
    their graph; budgeted, it keeps the inputs and itself."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 10)
    ).double()
    x = torch.randn(16, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    backend = DiffBackPackGGN(model, "classification")
    params = list(model.parameters())
    whole = held_bytes([ntk(backend, x)], exclude=[x, *params])
    budget = whole // 4
    with memory_budget(budget):
        K = ntk(backend, x)
    kept = held_bytes([K], exclude=[x, *params]) - K.untyped_storage().nbytes()
    assert kept <= budget < whole
    assert K.grad_fn is not None and "Recomputed" in type(K.grad_fn).__name__


def test_a_request_that_cannot_fit_fails_before_any_work_and_names_the_budget():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2)).double()
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    backend = DiffBackPackGGN(model, "classification")
    before = model_state(model)
    with memory_budget(100), pytest.raises(MemoryBudgetError) as info:
        ntk(backend, x)
    message = str(info.value)
    assert "100 B" in message and "memory budget" in message
    assert "set_memory_budget" in message and "One input's features take" in message
    with memory_budget(100), pytest.raises(MemoryBudgetError, match="ntk_diag"):
        ntk_diag(backend, x)
    assert_same_state(before, model_state(model))
    assert x.grad is None


def test_a_second_derivative_of_a_recomputed_gram_raises():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    with memory_budget(TINY // 4):
        K = ntk(DiffBackPackGGN(model, "classification"), x)
    with pytest.raises(RuntimeError, match="differentiable once.*memory budget"):
        torch.autograd.grad(K.sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(K.sum(), x)  # once is fine
    assert torch.isfinite(g).all()


def test_without_gradients_the_chunked_gram_keeps_no_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    backend = DiffFuncGGN(model, "classification")
    expected = ntk(backend, x, structured=False).detach()
    with torch.no_grad(), memory_budget(TINY // 4):
        K = ntk(backend, x, structured=False)
        D = ntk_diag(backend, x)
    assert K.grad_fn is None and D.grad_fn is None
    torch.testing.assert_close(K, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(D, torch.einsum("aace->ace", expected))


def test_dict_inputs_chunk_without_gradients_and_refuse_one_that_needs_recomputing():
    """Dict inputs are chunked under ``torch.no_grad()`` (same numbers as whole);
    with a gradient possible and no room for the whole graph, they are refused
    before any work, since only tensors are recomputed in chunks."""
    torch.manual_seed(0)
    model = DictModel().double()
    gen = torch.Generator().manual_seed(2)
    x = {
        "u": torch.randn(6, 4, generator=gen, dtype=torch.float64),
        "v": torch.randn(6, 2, generator=gen, dtype=torch.float64),
    }
    backend = DiffBackPackGGN(model, "classification")
    with torch.no_grad():
        K_whole, D_whole = ntk(backend, x), ntk_diag(backend, x)
    one = torch.tensor(1.0, dtype=torch.float64)
    budget, plan = _smallest_budget(backend, x, (6, 6), True, one, grad=False)
    assert plan.chunked and plan.chunk < 6
    with torch.no_grad(), memory_budget(budget):
        K, D = ntk(backend, x), ntk_diag(backend, x)
    torch.testing.assert_close(K, K_whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(D, D_whole, rtol=1e-12, atol=1e-14)
    before = model_state(model)
    budget, plan = _smallest_budget(backend, x, (6, 6), True, one)
    assert plan.chunked
    for call in (ntk, ntk_diag):
        with memory_budget(budget), pytest.raises(MemoryBudgetError, match="dict"):
            call(backend, x)  # the parameters require gradients
    assert_same_state(before, model_state(model))


def _relu_cnn_and_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 3)
    ).double()
    x = torch.randn(6, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    return model, x


@pytest.mark.parametrize(
    "call", ["grad-x", "backward", "backward-params", "grad-x-no-engine-query"]
)
def test_each_way_of_asking_for_a_budgeted_gradient_gets_the_reference(
    call, monkeypatch
):
    """``autograd.grad(K, x)``, ``K.backward()`` and ``backward(inputs=params)``:
    the backward pass computes only what the call uses, and what it computes is
    the reference's (also where PyTorch cannot say what the call uses). A ReLU
    network: its signals do not depend on ``x``."""
    model, x = _relu_cnn_and_inputs()
    params = list(model.parameters())
    backend = DiffBackPackGGN(model, "classification")
    one = torch.tensor(1.0, dtype=torch.float64)
    budget, plan = _smallest_budget(backend, x, (6, 6), True, one)
    with memory_budget(budget):
        K = ntk(backend, x)
        D = ntk_diag(backend, x)
    assert plan.chunked and "Recomputed" in type(K.grad_fn).__name__
    K_ref, D_ref = _reference(model, x, x, one)
    expected = _grads(_functional(K_ref, D_ref), [x, *params])
    loss = _functional(K, D)
    if call == "grad-x-no-engine-query":
        # a PyTorch without the query: every gradient is computed, as before
        monkeypatch.delattr(torch._C, "_will_engine_execute_node")
        call = "grad-x"
    if call == "grad-x":
        got = list(torch.autograd.grad(loss, x))
        expected = expected[:1]
        assert all(p.grad is None for p in params)
    elif call == "backward":
        loss.backward()
        got = [x.grad, *(p.grad for p in params)]
        # the output bias's Jacobian is constant: no gradient reaches it
        got = [torch.zeros_like(e) if g is None else g for g, e in zip(got, expected)]
    else:
        loss.backward(inputs=params)
        assert x.grad is None
        got = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        expected = expected[1:]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


class _CountedFlops(TorchDispatchMode):
    """Counts the FLOPs of the matmul-like ATen operations run under it, by
    PyTorch's own formulas (``FlopCounterMode``'s hooks refuse
    ``autograd.grad`` inside a backward pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.count += formula(*args, **kwargs, out_val=out)
        return out


def test_a_gradient_in_the_inputs_alone_skips_the_parameters_work():
    """Counted in FLOPs: ``autograd.grad(K, x)`` does less than a pass
    that also wants the parameters' gradients (it sends nothing to the
    signals, which a gradient in ``x`` does not need). Before, it did the same
    work either way."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)
    ).double()
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    params = list(model.parameters())
    backend = DiffBackPackGGN(model, "classification")
    one = torch.tensor(1.0, dtype=torch.float64)
    budget, _ = _smallest_budget(backend, x, (6, 6), True, one)

    def backward_flops(inputs):
        with memory_budget(budget):
            K = ntk(backend, x)
        with _CountedFlops() as counted:
            torch.autograd.grad(K.square().sum(), inputs, allow_unused=True)
        return counted.count

    only_x = backward_flops([x])
    with_params = backward_flops([x, *params])
    assert 0 < only_x < 0.8 * with_params
