"""Contract 8: bad input gets a clear error and leaves the model untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import (
    DiffBackPackEF,
    DiffBackPackGGN,
    DiffFuncGGN,
    InvalidInputError,
    UnsupportedModuleError,
)
from tests.backends.methods import kron_friendly_mlp, method_calls
from tests.conftest import BACKENDS
from tests.references import assert_same_state, model_state

BACKPACK_BACKENDS = [DiffBackPackGGN, DiffBackPackEF]


BAD_DICT_INPUTS = {
    "no tensors": ({"ids": [1, 2]}, "holds no tensors"),
    "empty batch": ({"ids": torch.zeros(0, 3, dtype=torch.long)}, "empty batch"),
    "disagreeing batch sizes": (
        {"a": torch.zeros(2, 3), "b": torch.zeros(3, 3)},
        "disagree on the batch size",
    ),
    "scalar": ({"ids": torch.tensor(1)}, "scalars"),
    "wrong dtype": ({"x": torch.zeros(2, 3, dtype=torch.float32)}, r"x\['x'\].to"),
    "wrong device": ({"x": torch.zeros(2, 3, device="meta")}, r"x\['x'\].to"),
}


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("what", list(BAD_DICT_INPUTS))
def test_bad_dict_inputs_are_named(backend_cls, what):
    x, message = BAD_DICT_INPUTS[what]
    model = kron_friendly_mlp()
    before = model_state(model)
    backend = backend_cls(model, "classification")
    with pytest.raises(InvalidInputError, match=message):
        backend.jacobians(x, enable_backprop=True)
    assert_same_state(before, model_state(model))


BAD_INPUTS = {
    "empty batch": (torch.zeros(0, 3, dtype=torch.float64), "empty batch"),
    "wrong dtype": (torch.zeros(2, 3, dtype=torch.float32), "x.to"),
    "wrong device": (torch.zeros(2, 3, dtype=torch.float64, device="meta"), "x.to"),
    "scalar": (torch.tensor(1.0, dtype=torch.float64), "scalar"),
    "not a tensor": ([[0.0, 1.0, 2.0]], "torch.Tensor"),
}


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("what", list(BAD_INPUTS))
def test_bad_inputs_are_named(backend_cls, what):
    x, message = BAD_INPUTS[what]
    model = kron_friendly_mlp()
    before = model_state(model)
    backend = backend_cls(model, "classification")
    y = torch.zeros(2, dtype=torch.long)
    for call in method_calls(backend_cls).values():
        if backend_cls is DiffFuncGGN and what == "not a tensor":
            continue  # torch.func backends accept pytrees; nothing to check here
        with pytest.raises((InvalidInputError, ValueError), match=message):
            call(backend, x, y)
    assert_same_state(before, model_state(model))


class _Boom(nn.Module):
    """Raises in forward or in backward on demand."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def forward(self, x):
        if self.where == "forward":
            raise RuntimeError("boom in forward")
        if self.where == "backward":
            return _FailingBackward.apply(x)
        return x


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, x):
        return _FailingBackward.apply(x), in_dims[0]

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.__name__)
def test_exceptions_leave_nothing_behind(backend_cls, where):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), _Boom(where), nn.Linear(4, 3))
    model = model.double()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = model_state(model)
    backend = backend_cls(model, "classification")
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    y = torch.zeros(2, dtype=torch.long)
    for name, call in method_calls(backend_cls).items():
        with pytest.raises(Exception, match="boom"):
            call(backend, x, y)
        assert_same_state(before, model_state(model))
        assert x.grad is None, name


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "picked, message",
    [
        (torch.tensor([0, 1, 0]), "rows but the batch has 2"),
        (torch.tensor([0, 5]), r"must lie in \[0, 3\)"),
    ],
    ids=["wrong rows", "out of range"],
)
def test_bad_output_selectors(backend_cls, picked, message):
    model = kron_friendly_mlp()
    before = model_state(model)
    x = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match=message):
        backend_cls(model, "classification").selected_output_jacobians(x, picked)
    assert_same_state(before, model_state(model))


class _AttentionWeightsModel(nn.Module):
    """Uses MultiheadAttention's returned weights in its output (not supported)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.attention(x, x, x, need_weights=True)
        return self.head(out.mean(1)) + weights.sum((1, 2))[:, None]


@pytest.mark.parametrize("backend_cls", BACKPACK_BACKENDS, ids=lambda c: c.__name__)
def test_attention_weights_in_the_output_point_to_functorch_backend(backend_cls):
    torch.manual_seed(0)
    model = _AttentionWeightsModel().double().eval()
    before = model_state(model)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    with pytest.raises(UnsupportedModuleError, match="DiffFuncGGN"):
        backend_cls(model, "regression").jacobians(x)
    assert_same_state(before, model_state(model))


FIRST_LINEAR_INPUTS = {
    "integer": (torch.zeros(4, 3, dtype=torch.long), "x.to"),
    "unbatched 1-D": (torch.zeros(3, dtype=torch.float64), "x\\[None\\]"),
    "wrong width": (torch.zeros(4, 5, dtype=torch.float64), "last dimension to be 3"),
}


@pytest.mark.parametrize("case", list(FIRST_LINEAR_INPUTS))
@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.__name__)
def test_input_a_first_linear_cannot_take_is_named_before_the_model_runs(
    backend_cls, case
):
    """Not PyTorch's raw ``mat1 and mat2`` error from inside the forward pass."""
    x, fix = FIRST_LINEAR_INPUTS[case]
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    before = model_state(model)
    with pytest.raises(InvalidInputError, match=fix):
        backend_cls(model, "regression").jacobians(x)
    assert not calls, "the model ran"
    assert_same_state(before, model_state(model))
