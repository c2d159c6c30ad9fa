"""``preserved_state`` puts a model's Python-level state back, also on exceptions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac.jacobians._engine import jacobian_factors
from laplace_diffjac.jacobians._model_guard import (
    ModelSurvey,
    preserved_state,
    runs_only_torch_modules,
    survey,
)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _state(model: nn.Module) -> tuple:
    """Every module's attribute dict (identities) and hook keys, every tensor's
    ``.grad`` identity and extra attributes."""
    modules = [
        (
            {k: id(v) for k, v in vars(m).items()},
            {
                name: tuple(d)
                for name, d in vars(m).items()
                if name.endswith("hooks") and isinstance(d, dict)
            },
        )
        for m in model.modules()
    ]
    tensors = [
        (id(p.grad), {k: id(v) for k, v in vars(p).items()})
        for p in [*model.parameters(), *model.buffers()]
    ]
    return modules, tensors


def _meddle(model: nn.Sequential) -> None:
    """What a computation might leave behind: new, rebound and deleted
    attributes, hooks of every kind, ``.grad`` and tensor attributes."""
    first, last = model[0], model[2]
    first.input0 = torch.ones(1)  # new
    first.training = not first.training  # rebound
    del last.user_note  # deleted
    first.register_forward_hook(lambda *a: None)
    first.register_forward_pre_hook(lambda *a: None)
    last.register_full_backward_hook(lambda *a: None)
    last.register_forward_hook(lambda *a, **k: None, with_kwargs=True)
    model.register_forward_pre_hook(lambda *a, **k: None, with_kwargs=True)
    first.weight.grad = torch.zeros_like(first.weight)
    last.weight.grad = None
    first.bias.grad_batch = torch.zeros(2, 4)  # new tensor attribute
    last.bias.note = "rebound"


def _prepared() -> nn.Sequential:
    model = _model()
    model[2].user_note = "kept"
    model[2].weight.grad = torch.ones_like(model[2].weight)
    model[2].bias.note = "original"
    model[0].register_forward_hook(lambda *a: None)  # the user's: stays
    return model


def test_every_change_is_undone():
    model = _prepared()
    before = _state(model)
    with preserved_state(model):
        _meddle(model)
        assert _state(model) != before  # the meddling did change it
    assert _state(model) == before
    assert model[2].user_note == "kept" and model[2].bias.note == "original"
    assert len(model[0]._forward_hooks) == 1


def test_every_change_is_undone_after_an_exception():
    model = _prepared()
    before = _state(model)
    with pytest.raises(RuntimeError, match="mid-computation"):
        with preserved_state(model):
            _meddle(model)
            raise RuntimeError("mid-computation")
    assert _state(model) == before


def test_a_replaced_hook_dict_is_put_back():
    model = _prepared()
    hooks = model[0]._forward_hooks
    with preserved_state(model):
        model[0]._forward_hooks = {}
    assert model[0]._forward_hooks is hooks and len(hooks) == 1


def test_only_torch_modules_without_hooks_run_unguarded():
    model = _model()
    assert runs_only_torch_modules(model)
    model[1].register_forward_pre_hook(lambda *a: None)
    assert not runs_only_torch_modules(model)


def test_a_backward_hook_a_subclass_or_a_global_hook_asks_for_the_guard():
    hooked = _model()
    hooked[2].register_full_backward_hook(lambda *a: None)
    assert not runs_only_torch_modules(hooked)

    class Tanh(nn.Tanh):
        pass

    assert not runs_only_torch_modules(nn.Sequential(nn.Linear(3, 2), Tanh()))
    model = _model()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert not runs_only_torch_modules(model)
    finally:
        handle.remove()
    assert runs_only_torch_modules(model)


def test_what_a_users_hook_writes_during_the_engine_is_undone():
    model = _model()

    def note(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        module.seen = output.shape  # the user's hook writes an attribute

    model[0].register_forward_hook(note)
    params = list(model.parameters())
    jacobian_factors(model, torch.randn(4, 3), params)
    assert not hasattr(model[0], "seen")
    assert len(model[0]._forward_hooks) == 1  # the user's hook stays


def test_the_survey_tells_hooks_and_foreign_classes_apart():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model()

    assert survey(Net()) == ModelSurvey(hook_free=True, torch_only=False)
    hooked = _model()
    hooked[2].register_forward_hook(lambda *a: None)
    assert survey(hooked) == ModelSurvey(hook_free=False, torch_only=True)
    assert survey(_model()).plain
