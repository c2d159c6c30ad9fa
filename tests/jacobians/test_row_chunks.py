"""The curvature's rows sent back in chunks (``_engine.row_chunked_factors``).

With a budget that lets one row through at a time, the GGN diagonal (exact and
Monte Carlo), the empirical Fisher's and the Kronecker factors (KFLR of
convolutions, KFAC expand and reduce of Linear and Embedding layers, the exact
blocks of norms, the nearest Kronecker product of a shared layer's weight) equal
those of all rows at once to 1e-10 in float64, and the float64 references of
``tests/curvature_references.py``; the rows do go back one at a time, and an
exception between two chunks leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN
from laplace_diffjac.jacobians import _engine
from laplace_diffjac.jacobians._engine import row_chunked_factors
from tests.class_models import MODELS, PlainBlock, built
from tests.curvature_references import assert_kron_close, kron_reference

LIKELIHOODS = ["classification", "regression"]


class _Scale(nn.Module):
    """A module of no rule (the local rule) with a ``(2, 3)`` weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.flatten()


def _case(name: str, n: int = 5) -> tuple[nn.Module, object]:
    if name == "nearest":  # nearest Kronecker product, exact norm blocks
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(4, 6), nn.Tanh(), _Scale(), nn.LayerNorm(6), nn.Linear(6, 3)
        )
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
        return model.double().eval(), x
    if name == "resnet":
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, 1, 1), PlainBlock(4, 4, 1), PlainBlock(4, 5, 2),
            nn.Flatten(), nn.Linear(5 * 9, 3),
        )  # fmt: skip
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(n, 3, 6, 6, generator=gen, dtype=torch.float64)
        return model.double().eval(), x
    return built(name, n)


def _targets(likelihood: str, n: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    if likelihood == "classification":
        return torch.randint(0, 3, (n,), generator=gen)
    return torch.randn(n, 3, generator=gen, dtype=torch.float64)


NAMES = ["resnet", "nearest", *MODELS]
#: Cases the KFAC reference takes (one call per layer and sample, tensor inputs,
#: no attention).
REFERENCE = ["resnet", "nearest", "cnn", "layer-norm"]


@pytest.fixture
def one_row_at_a_time(monkeypatch) -> Iterator[list[int]]:
    """Chunks of one row; yields the rows of every chunk sent back."""
    chunks: list[int] = []
    batched = _engine._batched_grad

    def counted(f, outputs, signals, create_graph):
        chunks.append(int(signals.shape[0]))
        return batched(f, outputs, signals, create_graph)

    monkeypatch.setattr(_engine, "ROW_CHUNK_BYTES", 1)
    monkeypatch.setattr(_engine, "_batched_grad", counted)
    yield chunks


def _all_at_once(fn):
    """``fn()`` with every row in one chunk (the budget unbounded)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_engine, "ROW_CHUNK_BYTES", 2**62)
        return fn()


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("name", NAMES)
def test_diagonal_in_chunks_equals_all_rows_at_once(
    name, likelihood, stochastic, one_row_at_a_time
) -> None:
    model, x = _case(name)
    y = _targets(likelihood)
    backend = DiffBackPackGGN(model, likelihood, stochastic=stochastic)
    torch.manual_seed(3)
    loss, diag = backend.diag(x, y)
    rows = 1 if stochastic else 3
    assert one_row_at_a_time == [1] * rows
    torch.manual_seed(3)
    loss_once, once = _all_at_once(lambda: backend.diag(x, y))
    _close(diag, once)
    _close(loss, loss_once)
    assert diag.abs().sum() > 0


@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("name", NAMES)
def test_ef_diagonal_in_chunks_equals_all_rows_at_once(
    name, likelihood, one_row_at_a_time
) -> None:
    model, x = _case(name)
    y = _targets(likelihood)
    backend = DiffBackPackEF(model, likelihood)
    _, diag = backend.diag(x, y)
    _close(diag, _all_at_once(lambda: backend.diag(x, y))[1])


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("likelihood", LIKELIHOODS)
@pytest.mark.parametrize("name", NAMES)
def test_kron_in_chunks_equals_all_rows_at_once_and_the_reference(
    name, likelihood, approx, one_row_at_a_time
) -> None:
    model, x = _case(name)
    y = _targets(likelihood)
    backend = DiffBackPackGGN(model, likelihood, kfac_approx=approx)
    _, kron = backend.kron(x, y, N=5)
    assert one_row_at_a_time == [1, 1, 1]
    _, once = _all_at_once(lambda: backend.kron(x, y, N=5))
    for got, expected in zip(kron.kfacs, once.kfacs, strict=True):
        for a, b in zip(got, expected, strict=True):
            _close(a, b)
    if name in REFERENCE:
        expected = kron_reference(model, [(x, y)], likelihood, kfac_approx=approx)
        assert_kron_close(kron.kfacs, expected, 1e-10)


def test_an_exception_between_chunks_leaves_the_model_as_it_was() -> None:
    model, x = _case("resnet")
    params = list(model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen: list[int] = []

    def consume(parts: _engine.JacobianFactors) -> None:
        seen.append(parts.n_rows)
        if len(seen) == 2:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        row_chunked_factors(
            model, x, params, lambda f: torch.ones(3, *f.shape, dtype=f.dtype),
            consume, chunk_bytes=1,
        )  # fmt: skip
    assert seen == [1, 1]
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._backward_hooks
    after = model.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert all(p.grad is None for p in params)
    f = row_chunked_factors(
        model, x, params, lambda f: torch.ones(1, *f.shape, dtype=f.dtype),
        lambda parts: None,
    )  # fmt: skip
    torch.testing.assert_close(f, model(x).detach())
