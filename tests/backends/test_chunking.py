"""Jacobians in chunks of the batch under ``jacobian_budget``.

The dense curvature and the Jacobians computed two samples at a time equal a
float64 ``vmap(jacrev)`` reference and the one-chunk result; no chunk exceeds the
budget; a single sample above the budget is refused with an error naming it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

import laplace_diffjac.backends._backpack as backpack_module
from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN
from laplace_diffjac.budget import memory_budget
from laplace_diffjac.errors import InvalidInputError, MemoryBudgetError
from tests.backends.methods import kron_friendly_mlp
from tests.references import reference_jacobians

B, C = 7, 3
TOL = dict(rtol=1e-10, atol=1e-12)


def _data(likelihood: str):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(B, 3, dtype=torch.float64, generator=gen)
    if likelihood == "classification":
        return x, torch.randint(0, C, (B,), generator=gen)
    return x, torch.randn(B, C, dtype=torch.float64, generator=gen)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _two_samples(model, rows: int = C) -> int:
    """A budget that holds two samples' Jacobians, not three."""
    return 2 * rows * _n_params(model) * 8 + 7


def _reference_ggn(model, x, likelihood) -> torch.Tensor:
    Js, f = reference_jacobians(model, x)
    if likelihood == "regression":
        return torch.einsum("bcp,bcq->pq", Js, Js)
    p = torch.softmax(f, dim=-1)
    hessian = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("bcp,bck,bkq->pq", Js, hessian, Js)


@pytest.fixture
def chunk_sizes(monkeypatch):
    """Batch sizes the engine is called with."""
    sizes: list[int] = []
    original = backpack_module.parameter_jacobians

    def spy(model, x, *args, **kwargs):
        sizes.append(x.shape[0])
        return original(model, x, *args, **kwargs)

    monkeypatch.setattr(backpack_module, "parameter_jacobians", spy)
    return sizes


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_chunked_ggn_equals_reference_and_one_chunk(likelihood, chunk_sizes):
    model = kron_friendly_mlp(C)
    model.output_size = C  # as laplace-torch's fit sets it
    x, y = _data(likelihood)
    chunked = DiffBackPackGGN(model, likelihood, jacobian_budget=_two_samples(model))
    loss, H = chunked.full(x, y)
    assert chunk_sizes == [2, 2, 2, 1]
    whole_loss, whole_H = DiffBackPackGGN(model, likelihood).full(x, y)
    assert chunk_sizes[4:] == [B]
    torch.testing.assert_close(H, _reference_ggn(model, x, likelihood), **TOL)
    torch.testing.assert_close(H, whole_H, **TOL)
    torch.testing.assert_close(loss, whole_loss, **TOL)


def test_chunked_jacobians_equal_reference(chunk_sizes):
    """Without ``model.output_size`` the first sample alone gives the outputs."""
    model = kron_friendly_mlp(C)
    x, _ = _data("regression")
    backend = DiffBackPackGGN(model, "regression", jacobian_budget=_two_samples(model))
    Js, f = backend.jacobians(x)
    assert chunk_sizes == [1, 2, 2, 2]
    Js_ref, f_ref = reference_jacobians(model, x)
    torch.testing.assert_close(Js, Js_ref, **TOL)
    torch.testing.assert_close(f, f_ref, **TOL)


def test_chunked_empirical_fisher_equals_reference():
    model = kron_friendly_mlp(C)
    x, y = _data("classification")
    budget = _two_samples(model, rows=1)
    _, H = DiffBackPackEF(model, "classification", jacobian_budget=budget).full(x, y)
    grads = []
    for xi, yi in zip(x, y):
        loss = torch.nn.functional.cross_entropy(
            model(xi[None]), yi[None], reduction="sum"
        )
        grads.append(
            torch.cat(
                [
                    g.flatten()
                    for g in torch.autograd.grad(loss, list(model.parameters()))
                ]
            )
        )
        model.zero_grad(set_to_none=True)
    G = torch.stack(grads)
    torch.testing.assert_close(H, G.T @ G, **TOL)


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_budget_through_laplace_backend_kwargs(subset):
    model = kron_friendly_mlp(C)
    x, y = _data("classification")
    loader = DataLoader(TensorDataset(x, y), batch_size=B)
    fits = []
    for kwargs in ({}, {"jacobian_budget": _two_samples(model)}):
        la = Laplace(
            copy.deepcopy(model), "classification", subset, "full",
            backend=DiffBackPackGGN, backend_kwargs=kwargs,
        )  # fmt: skip
        la.fit(loader)
        fits.append(la)
    assert fits[1].backend.jacobian_budget == _two_samples(model)
    torch.testing.assert_close(fits[1].H, fits[0].H, **TOL)
    torch.testing.assert_close(
        fits[1]._glm_predictive_distribution(x)[1],
        fits[0]._glm_predictive_distribution(x)[1],
        **TOL,
    )


def test_a_sample_above_the_budget_is_refused_by_name():
    model = kron_friendly_mlp(C)
    x, y = _data("regression")
    one_sample = C * _n_params(model) * 8
    backend = DiffBackPackGGN(model, "regression", jacobian_budget=one_sample - 1)
    with pytest.raises(
        InvalidInputError, match=f"jacobian_budget of {one_sample - 1} bytes"
    ):
        backend.full(x, y)
    with pytest.raises(InvalidInputError, match="jacobian_budget"):
        backend.jacobians(x)
    DiffBackPackGGN(model, "regression", jacobian_budget=one_sample).full(x, y)


@pytest.mark.parametrize("budget", [0, -5, 1.5, True, "1GB"])
def test_bad_budget_is_refused(budget):
    with pytest.raises(
        InvalidInputError, match="jacobian_budget must be a positive int"
    ):
        DiffBackPackGGN(kron_friendly_mlp(C), "regression", jacobian_budget=budget)


def test_without_jacobian_budget_the_memory_budget_sizes_the_chunks(chunk_sizes):
    """Half the memory budget in force: two samples' Jacobians fit, three do not."""
    model = kron_friendly_mlp(C)
    x, y = _data("regression")
    backend = DiffBackPackGGN(model, "regression")
    with memory_budget(2 * _two_samples(model)):
        Js, _ = backend.jacobians(x)
        _, H = backend.full(x, y)
    assert chunk_sizes and max(chunk_sizes) == 2
    ref, _ = reference_jacobians(model, x)
    torch.testing.assert_close(Js, ref, **TOL)
    torch.testing.assert_close(H, _reference_ggn(model, x, "regression"), **TOL)
    one_sample = C * _n_params(model) * 8
    with memory_budget(2 * one_sample - 2), pytest.raises(MemoryBudgetError) as info:
        backend.jacobians(x)
    assert "set_memory_budget" in str(info.value)
    assert "hessian_structure='diag'/'kron'" in str(info.value)
