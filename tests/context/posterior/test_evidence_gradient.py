"""The evidence objective in Z, δ and σ against dense torch.func autograd.

Also within a memory budget too small for the locations or a batch in one piece,
and one too small for the locations' graph: the same value and gradients, in
chunks and blocks.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.budget import memory_budget
from laplace_diffjac.context import ContextPosterior, evidence_loss_backward
from laplace_diffjac.context.posterior import _evidence_gradient
from laplace_diffjac.context.posterior._evidence_blocks import BlockedGradientPlan
from laplace_diffjac.errors import MemoryBudgetError
from laplace_diffjac.kernels._feature_sizes import feature_sizes
from tests.context.helpers import MLP, dense_bound, evidence_data


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_value_and_gradients_match_dense_autograd(backend_cls, likelihood):
    model, x, y, loader = evidence_data(likelihood, n=12)
    z = MLP.inputs(3, 11).requires_grad_()
    log_prec = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    log_sigma = torch.tensor(-0.5, dtype=torch.float64, requires_grad=True)
    reg = likelihood == "regression"
    loss = evidence_loss_backward(
        backend_cls(model, likelihood),
        z,
        loader,
        likelihood,
        log_prec.exp(),
        log_sigma.exp(),
        jitter=0.0,
        inputs=[z, log_prec, log_sigma] if reg else [z, log_prec],
    )
    assert all(p.grad is None for p in model.parameters())
    z_ref = z.detach().clone().requires_grad_()
    lp = log_prec.detach().clone().requires_grad_()
    ls = log_sigma.detach().clone().requires_grad_()
    sigma = ls.exp() if reg else 1.0
    dense, _ = dense_bound(model, x, y, z_ref, likelihood, lp.exp(), sigma)
    leaves = [z_ref, lp, ls] if reg else [z_ref, lp]
    grads = torch.autograd.grad(-dense, leaves)
    torch.testing.assert_close(loss, -dense.detach(), rtol=1e-7, atol=1e-10)
    for leaf, g in zip([z, log_prec, log_sigma], grads):
        torch.testing.assert_close(leaf.grad, g, rtol=1e-6, atol=1e-9)
    cp = ContextPosterior(model, likelihood, z.detach(), jitter=0.0).fit(loader)
    s = log_sigma.detach().exp() if reg else None
    expected = cp.log_marginal_likelihood(log_prec.detach().exp(), s)
    torch.testing.assert_close(-loss, expected, rtol=1e-10, atol=0)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_within_a_small_budget_value_and_gradients_match_dense_autograd(
    likelihood, monkeypatch
):
    """Locations in blocks and batches of 6 in chunks: the dense bound and gradient."""
    model, x, y, _ = evidence_data(likelihood, n=12)
    loader = DataLoader(TensorDataset(x, y), batch_size=6)
    z = MLP.inputs(5, 11).requires_grad_()
    log_prec = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    seen: list[int] = []  # the sizes of the inputs whose features are computed
    features = _evidence_gradient.batch_features

    def counting(backend, inputs, *args, **kwargs):
        seen.append(len(inputs))
        return features(backend, inputs, *args, **kwargs)

    monkeypatch.setattr(_evidence_gradient, "batch_features", counting)
    with memory_budget("17 KiB"):
        loss = evidence_loss_backward(
            DiffBackPackGGN(model, likelihood), z, loader, likelihood,
            log_prec.exp(), torch.tensor(0.7, dtype=torch.float64), jitter=0.0,
            inputs=[z, log_prec],
        )  # fmt: skip
    # The locations whole only once (pass 2, with their graph), every other
    # piece in blocks or chunks smaller than the loader's batches of 6.
    pieces = [n for n in seen if n != 5]
    assert seen.count(5) == 1 and max(pieces) < 5 and sum(pieces) == 5 + 2 * len(x)
    z_ref = z.detach().clone().requires_grad_()
    lp = log_prec.detach().clone().requires_grad_()
    sigma = 0.7 if likelihood == "regression" else 1.0
    dense, _ = dense_bound(model, x, y, z_ref, likelihood, lp.exp(), sigma)
    grads = torch.autograd.grad(-dense, [z_ref, lp])
    torch.testing.assert_close(loss, -dense.detach(), rtol=1e-7, atol=1e-10)
    for leaf, g in zip([z, log_prec], grads):
        torch.testing.assert_close(leaf.grad, g, rtol=1e-6, atol=1e-9)


def test_a_budget_below_the_locations_graph_is_refused_before_work():
    model, x, y, loader = evidence_data("regression", n=12)
    z = MLP.inputs(5, 11).requires_grad_()
    prec = torch.tensor(1.0, dtype=torch.float64)
    with memory_budget("2 KiB"), pytest.raises(MemoryBudgetError) as info:
        evidence_loss_backward(
            DiffBackPackGGN(model, "regression"), z, loader, "regression", prec, prec
        )
    assert "fewer locations" in str(info.value)
    assert "set_memory_budget" in str(info.value)
    assert z.grad is None
    assert all(p.grad is None for p in model.parameters())


def _blocked_budget(backend, z, batch):
    """The smallest budget (steps of 2^(1/4)) at which pass 2 goes by blocks of
    locations, and its plan."""
    sizes = feature_sizes(backend, z.detach(), True)
    budget = 2.0**8
    while budget < 2.0**30:
        try:
            plan = _evidence_gradient._gradient_plan(sizes, len(z), batch, int(budget))
        except MemoryBudgetError:
            plan = None
        assert not isinstance(plan, int), "no budget goes by blocks"
        if plan is not None:
            return int(budget), plan
        budget *= 2**0.25
    raise AssertionError("no budget fits")


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_below_the_locations_graph_the_blocked_pass_matches_dense_autograd(
    likelihood, monkeypatch
):
    """A budget too small to hold the locations' graph: pass 2 computes the
    locations' features again, block by block, for every data chunk. With the
    plan that budget chooses, and with given plans (the locations' features
    without graph held, or computed per use too; uneven blocks and chunks), the
    value and every gradient are the dense bound's."""
    model, x, y, _ = evidence_data(likelihood, n=12)
    loader = DataLoader(TensorDataset(x, y), batch_size=6)
    z = MLP.inputs(5, 11).requires_grad_()
    backend = DiffBackPackGGN(model, likelihood)
    budget, chosen = _blocked_budget(backend, z, 6)
    assert chosen.block < len(z) and chosen.chunk < 6, chosen
    plans = [chosen, BlockedGradientPlan(2, 4, False, 0)]
    plans += [BlockedGradientPlan(3, 5, True, 0), BlockedGradientPlan(5, 6, False, 0)]
    taken = []
    blocked = _evidence_gradient.blocked_data_gradient

    def spy(*args):
        taken.append(args[-1])
        return blocked(*args)

    monkeypatch.setattr(_evidence_gradient, "blocked_data_gradient", spy)
    z_ref = z.detach().clone().requires_grad_()
    lp = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    sigma = 0.7 if likelihood == "regression" else 1.0
    dense, _ = dense_bound(model, x, y, z_ref, likelihood, lp.exp(), sigma)
    want = torch.autograd.grad(-dense, [z_ref, lp])
    planner = _evidence_gradient._gradient_plan
    for plan in plans:
        given = plan is not chosen
        monkeypatch.setattr(
            _evidence_gradient,
            "_gradient_plan",
            (lambda *a, p=plan: p) if given else planner,
        )
        z.grad = None
        log_prec = lp.detach().clone().requires_grad_()
        with memory_budget(budget):
            loss = evidence_loss_backward(
                backend, z, loader, likelihood, log_prec.exp(),
                torch.tensor(0.7, dtype=torch.float64), jitter=0.0,
                inputs=[z, log_prec],
            )  # fmt: skip
        assert taken[-1] == plan
        torch.testing.assert_close(loss, -dense.detach(), rtol=1e-10, atol=1e-12)
        for leaf, g in zip([z, log_prec], want):
            torch.testing.assert_close(leaf.grad, g, rtol=1e-9, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())
