"""A location step within the memory budget gives the whole step's value and gradient.

For plans that hold the locations' features in blocks, or compute them again
for every use (given, and as small budgets choose them), with the minibatch's
features held or computed again at each use, whole or in narrower column
blocks, the minibatch's Nyström gap and its gradient in ``Z`` equal a float64
reference built from per-sample autograd Jacobians (an independent route), to
1e-10, on all three routes (structured features, per-layer factors,
Jacobians); ``optimize_locations`` under such a budget, in memory and
streamed, takes the unbudgeted run's steps. A budget that not even one location
fits is refused before any step; a small one narrows the columns before it
gives up holding the locations' features.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import laplace_diffjac
from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.context import optimize_locations
from laplace_diffjac.context.locations._batch_pieces import RecomputedPieces
from laplace_diffjac.context.locations._budgeted_step import (
    StepPlan,
    budgeted_gap,
    plan_step,
    route_sizes,
)
from laplace_diffjac.context.locations._gap import pieces_trace
from laplace_diffjac.context.locations._routes import (
    FactorRoute,
    JacobianRoute,
    make_route,
    piece_tensors,
)
from laplace_diffjac.kernels import output_hessians
from tests.context.helpers import small_cnn, small_mlp
from tests.references import reference_jacobians

F64 = torch.float64
JITTER = 1e-6


CASES = {
    "features": (small_mlp, (4,), None, FactorRoute),
    "factors": (small_cnn, (1, 8, 8), None, FactorRoute),
    "jacobians": (small_cnn, (1, 8, 8), False, JacobianRoute),
}


def _reference(model, x, z, lam, prec):
    """Gap and its gradient in ``z`` from per-sample autograd Jacobians, float64."""
    z = z.detach().clone().requires_grad_()
    Jx, _ = reference_jacobians(model, x, loop=True)
    Jz, _ = reference_jacobians(model, z, loop=True)
    M, C, _ = Jz.shape
    Kzz = torch.einsum("acp,bep->acbe", Jz, Jz).reshape(M * C, M * C) / prec
    eps = JITTER * Kzz.diagonal().mean()
    Kzz = Kzz + eps * torch.eye(M * C, dtype=F64)
    Kzx = torch.einsum("acp,bep->acbe", Jz, Jx).reshape(M * C, -1) / prec
    Q = (Kzx.T @ torch.linalg.solve(Kzz, Kzx)).reshape(len(x), C, len(x), C)
    Knn = torch.einsum("bcp,bep->bce", Jx, Jx) / prec
    gap = torch.einsum("bce,bce->", lam, Knn - torch.einsum("acae->ace", Q))
    (grad,) = torch.autograd.grad(gap, z)
    return gap.detach(), grad


def _chunking_plans(sizes, n_locations, batch, chunk):
    """``(budget, plan)`` for budgets in steps of 2^(1/4) from 1 KiB, up to the
    first whole step: every budget whose plan chunks (those refused left out)."""
    budget = 2.0**10
    while budget < 2.0**34:
        try:
            plan = plan_step(sizes, n_locations, batch, chunk, int(budget))
        except laplace_diffjac.MemoryBudgetError:
            plan = None
        if plan is not None and plan.whole:
            return
        if plan is not None:
            yield int(budget), plan
        budget *= 2**0.25


def _budgets(route, z, batch, chunk):
    """The smallest budgets whose plans chunk, by kind of plan: the locations'
    features held or recomputed, the minibatch's held or not."""
    found = {}
    for budget, plan in _chunking_plans(route_sizes(route, z), len(z), batch, chunk):
        kind = ("hold" if plan.hold else "recompute", plan.hold_batch)
        found.setdefault(kind, (budget, plan))
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_budgeted_step_equals_the_reference_gap_and_gradient(case):
    build, shape, structured, kind = CASES[case]
    model = build()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, *shape, generator=gen, dtype=F64)
    z = torch.randn(5, *shape, generator=gen, dtype=F64)
    lam = output_hessians(model(x).detach(), "classification").to(F64)
    backend = DiffBackPackGGN(model, "classification")
    route = make_route(backend, 2.0, structured, torch.device("cpu"))
    assert isinstance(route, kind)
    pieces = [route.pieces(xc, graph=False) for xc in x.split(4)]
    trace = torch.cat(
        [pieces_trace(route, p, lc) for p, lc in zip(pieces, lam.split(4))]
    )
    want_gap, want_grad = _reference(model, x, z, lam, 2.0)
    plans = [StepPlan(1, True, False, 0), StepPlan(2, False, False, 0)]
    plans += [StepPlan(3, True, False, 0), StepPlan(5, False, False, 0)]
    # the minibatch's chunks (4, 4, 1) in narrower column blocks, some uneven
    plans += [
        StepPlan(2, True, False, 0, True, 3),
        StepPlan(3, False, False, 0, True, 1),
    ]
    plans += [plan for _, plan in _budgets(route, z, len(x), 4).values()]
    recomputed = RecomputedPieces(route, x.split(4))
    for plan, batch_pieces in itertools.product(plans, [pieces, recomputed]):
        args = (route, plan, z, batch_pieces, lam, trace, JITTER)
        gap, grad = budgeted_gap(*args)
        torch.testing.assert_close(gap, want_gap, rtol=1e-10, atol=0)
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
        value, none = budgeted_gap(*args, False)
        assert none is None
        torch.testing.assert_close(value, want_gap, rtol=1e-10, atol=0)


def test_a_small_budget_narrows_the_columns_before_it_recomputes_the_locations():
    """Where one location's Gram against a whole chunk of the minibatch does not
    fit but against fewer inputs does, the plan holds the locations' features and
    narrows the columns; every plan counts at most the budget."""
    model = small_cnn()
    z = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    route = make_route(DiffBackPackGGN(model, "classification"), 1.0, None, z.device)
    sizes = route_sizes(route, z)
    batch, chunk = 16, 8
    narrowed = 0
    for budget, plan in _chunking_plans(sizes, len(z), batch, chunk):
        assert plan.needs <= budget
        assert plan.width is None or 1 <= plan.width < chunk
        if plan.hold_batch:
            # with columns of one input the locations are held: so here too
            narrowest = plan_step(sizes, len(z), batch, 1, budget)
            assert plan.hold or not narrowest.hold, (budget, plan, narrowest)
            narrowed += plan.hold and plan.width is not None
    assert narrowed, "no budget narrowed the columns"


# The factor route only: on the Jacobian route of this small CNN, the whole step's
# graph is smaller than any block plan's (J's graph is little more than J), so
# no budget chooses blocks; its blocks are tested with given plans above.
@pytest.mark.parametrize("data", ["tensor", "loader"])
def test_optimiser_under_a_small_budget_takes_the_unbudgeted_steps(data):
    model = small_cnn()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(32, 1, 8, 8, generator=gen, dtype=F64)
    z0 = x[:4].clone()
    # streamed, a loader's batches are the minibatches; in memory, ``batch_size``
    source = x if data == "tensor" else DataLoader(TensorDataset(x), batch_size=16)
    kwargs = dict(
        init=z0, steps=4, batch_size=16, chunk_size=2, patience=0,
        progress_bar=False, evaluate_full=True, stream=data == "loader",
    )  # fmt: skip
    whole = optimize_locations(model, "classification", source, 4, **kwargs)
    backend = DiffBackPackGGN(model, "classification")
    route = make_route(backend, 1.0, None, torch.device("cpu"))
    budgets = _budgets(route, z0, 16, 2)
    # both kinds of blocks, and a minibatch whose features are computed per use
    assert {"hold", "recompute"} <= {kind for kind, _ in budgets}
    assert any(not plan.hold_batch for _, plan in budgets.values())
    for budget, _ in budgets.values():
        with laplace_diffjac.memory_budget(budget):
            run = optimize_locations(model, "classification", source, 4, **kwargs)
        torch.testing.assert_close(run.locations, whole.locations, rtol=1e-9, atol=0)
        assert run.history.objective == pytest.approx(whole.history.objective, 1e-10)
        assert run.history.final_objective == pytest.approx(
            whole.history.final_objective, rel=1e-10
        )


def test_a_step_nothing_fits_is_refused_before_any_step():
    model = small_cnn()
    x = torch.randn(12, 1, 8, 8, dtype=F64)
    with laplace_diffjac.memory_budget("4 KiB"):
        with pytest.raises(laplace_diffjac.MemoryBudgetError, match="location step"):
            optimize_locations(
                model, "classification", x, 3, init=x[:3], steps=2, progress_bar=False
            )


def test_the_step_is_planned_in_what_the_training_cache_leaves(monkeypatch):
    """The cached features stay through the steps: the plan gets the rest."""
    from laplace_diffjac.context.locations import _optimizer, _sources

    seen, caches = [], []
    plan, cache = _optimizer.plan_step, _sources.TrainingCache

    def spy_plan(sizes, M, batch, chunk, budget):
        seen.append(budget)
        return plan(sizes, M, batch, chunk, budget)

    def spy_cache(*args, **kwargs):
        caches.append(cache(*args, **kwargs))
        return caches[-1]

    monkeypatch.setattr(_optimizer, "plan_step", spy_plan)
    monkeypatch.setattr(_sources, "TrainingCache", spy_cache)
    x = torch.randn(12, 1, 8, 8, generator=torch.Generator().manual_seed(2), dtype=F64)
    with laplace_diffjac.memory_budget("64 MiB"):
        optimize_locations(
            small_cnn(), "classification", x, 3, init=x[:3], steps=1, progress_bar=False
        )
    (held,) = [c.held_bytes for c in caches]
    assert held > 0 and caches[0].pieces is not None  # the features were cached
    assert seen == [64 * 2**20 - held]


def test_a_streamed_step_is_planned_for_the_loaders_largest_batch(monkeypatch):
    """A loader's batches are the minibatches, whatever ``batch_size`` says."""
    from laplace_diffjac.context.locations import _optimizer

    seen = []
    plan = _optimizer.plan_step

    def spy_plan(sizes, M, batch, chunk, budget):
        seen.append(batch)
        return plan(sizes, M, batch, chunk, budget)

    monkeypatch.setattr(_optimizer, "plan_step", spy_plan)
    x = torch.randn(23, 1, 8, 8, generator=torch.Generator().manual_seed(2), dtype=F64)
    loader = DataLoader(TensorDataset(x), batch_size=9)  # 9, 9, 5
    optimize_locations(
        small_cnn(), "classification", loader, 3, init=x[:3], steps=1,
        batch_size=2, progress_bar=False, stream=True,
    )  # fmt: skip
    assert seen == [9]


@pytest.mark.parametrize("case", list(CASES))
def test_a_float32_models_pieces_are_held_in_float32_and_contracted_in_float64(case):
    """Half the memory of float64 copies, the Grams in float64: against the Gram
    of the model's per-sample autograd Jacobians (float32, then widened)."""
    build, shape, structured, kind = CASES[case]
    model = build().float()
    x = torch.randn(6, *shape, generator=torch.Generator().manual_seed(5))
    backend = DiffBackPackGGN(model, "classification")
    route = make_route(backend, 2.0, structured, torch.device("cpu"))
    assert isinstance(route, kind)
    pieces = route.pieces(x, graph=False)
    assert {t.dtype for t in piece_tensors(pieces)} == {torch.float32}
    J, _ = reference_jacobians(model, x, loop=True)
    J = J.detach().to(F64)
    want = torch.einsum("acp,bep->acbe", J, J).reshape(len(x) * J.shape[1], -1) / 2
    for K in (route.cross(pieces, pieces), route.self_gram(pieces)):
        assert K.dtype == F64
        torch.testing.assert_close(K, want, rtol=1e-5, atol=1e-6 * want.abs().max())
    sizes = route_sizes(route, x)
    held = sum(t.numel() * t.element_size() for t in piece_tensors(pieces))
    assert sizes.features == pytest.approx(held / len(x), rel=0.05)
    assert sizes.contracted == 2 * sizes.features
