"""Modules called on a tensor shared by the whole batch, their output broadcast.

BERT's position embeddings (position ids ``(1, T)``) are audited
(``audit_cases``: ``BERT-like-embeddings``); here a Linear layer on a shared
buffer, with gradients in the input and the NTK's factor route, and the refusal
when the model uses such an output other than by broadcasting it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN, UnsupportedModuleError
from laplace_diffjac.jacobians import parameter_jacobians
from laplace_diffjac.kernels import ntk
from tests.references import (
    assert_same_state,
    central_difference,
    loop_jacobians,
    model_state,
)


class _LearnedPositions(nn.Module):
    """Positions encoded by an MLP from a shared ``(1, T, 2)`` buffer."""

    def __init__(self, reduce_batch: bool = False) -> None:
        super().__init__()
        self.encode = nn.Linear(2, 4)
        self.embed = nn.Embedding(3, 4)
        self.head = nn.Linear(4, 3)
        self.reduce_batch = reduce_batch
        grid = torch.linspace(-1, 1, 3)
        self.register_buffer("grid", torch.stack([grid, grid**2], -1)[None])
        self.register_buffer("ids", torch.arange(3)[None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.tanh(self.encode(self.grid)) + self.embed(self.ids)
        if self.reduce_batch:  # not a broadcast: a sum over the batch dimension
            positions = positions.sum(0, keepdim=True)
        return self.head(torch.tanh(x + positions).mean(1))


def _model(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return _LearnedPositions(**kwargs).double()


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
def test_shared_input_jacobians_and_gradients_in_the_input(backend_cls):
    model = _model()
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    before = model_state(model)
    x_in = x.clone().requires_grad_(True)
    J, f = backend_cls(model, "regression").jacobians(x_in, enable_backprop=True)
    assert_same_state(before, model_state(model))
    J_ref, f_ref = loop_jacobians(model, x)
    torch.testing.assert_close(J, J_ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f, f_ref.detach(), rtol=1e-10, atol=1e-12)
    (g,) = torch.autograd.grad(J.square().sum(), x_in)
    u = torch.randn_like(x)
    expected = central_difference(
        lambda t: loop_jacobians(model, x + t * u)[0].square().sum()
    )
    torch.testing.assert_close((g * u).sum(), expected, rtol=1e-6, atol=1e-8)


def test_factor_route_of_the_ntk_on_shared_inputs():
    model = _model()
    x1 = torch.randn(4, 3, 4, dtype=torch.float64)
    x2 = torch.randn(3, 3, 4, dtype=torch.float64)
    K = ntk(DiffBackPackGGN(model, "regression"), x1, x2, structured=False)
    J1, _ = loop_jacobians(model, x1)
    J2, _ = loop_jacobians(model, x2)
    expected = torch.einsum("acp,bep->abce", J1, J2).detach()
    torch.testing.assert_close(K, expected, rtol=1e-10, atol=1e-12)


def test_shared_output_used_other_than_broadcast_is_refused_by_name():
    model = _model(reduce_batch=True)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    before = model_state(model)
    with pytest.raises(UnsupportedModuleError, match="encode.*shared by the batch"):
        parameter_jacobians(model, x, list(model.parameters()))
    assert_same_state(before, model_state(model))


def test_a_rerun_draws_the_dropout_masks_of_the_first_run():
    """In training mode with dropout, the expanded rerun must see the same masks,
    or its output would differ from the first run's and the model be refused."""
    torch.manual_seed(0)
    model = nn.Sequential(_LearnedPositions(), nn.Dropout(0.5)).double().train()
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    torch.manual_seed(4)
    _, f = parameter_jacobians(model, x, list(model.parameters()))
    after = torch.rand(3)
    torch.manual_seed(4)
    f_ref = model(x)  # one forward's masks, and the generator left as by one
    torch.testing.assert_close(f, f_ref, rtol=1e-12, atol=1e-14)
    assert torch.equal(after, torch.rand(3))
