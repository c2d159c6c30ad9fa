"""Contract 2: nothing but the results changes, for every method."""

from __future__ import annotations

import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import BatchGrad
from torch.func import functional_call, jacrev, vmap

from laplace_diffjac import DiffFuncGGN, UnsupportedModuleError
from tests.backends.methods import kron_friendly_mlp, method_calls
from tests.conftest import BACKENDS
from tests.references import assert_same_state, model_state

METHOD_CASES = [(cls, name) for cls in BACKENDS for name in method_calls(cls)]
IDS = [f"{cls.__name__}-{name}" for cls, name in METHOD_CASES]


def _data(batch: int = 4):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, 3, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 3, (batch,), generator=gen)
    return x, y


def _torch_func_works(model) -> None:
    params = dict(model.named_parameters())
    x, _ = _data()
    out = vmap(
        jacrev(lambda p, xi: functional_call(model, p, (xi[None],))), in_dims=(None, 0)
    )(params, x)
    assert all(torch.isfinite(v).all() for v in out.values())


@pytest.mark.parametrize("x_has_grad", [True, False], ids=["x.grad-set", "x.grad-None"])
@pytest.mark.parametrize(("backend_cls", "method"), METHOD_CASES, ids=IDS)
def test_model_params_and_leaf_input_untouched(backend_cls, method, x_has_grad):
    model = kron_friendly_mlp()
    for p in model.parameters():  # gradients a user had accumulated
        p.grad = torch.randn_like(p)
    before = model_state(model)
    backend = backend_cls(model, "classification")
    assert_same_state(before, model_state(model))  # construction changes nothing
    _torch_func_works(model)

    x, y = _data()
    x.requires_grad_(True)
    x.grad = torch.ones_like(x) if x_has_grad else None
    grad_before = x.grad
    result = method_calls(backend_cls)[method](backend, x, y)
    assert x.grad is grad_before
    if x_has_grad:
        assert torch.equal(x.grad, torch.ones_like(x))
    assert_same_state(before, model_state(model))
    _torch_func_works(model)
    del result


@pytest.mark.parametrize(("backend_cls", "method"), METHOD_CASES, ids=IDS)
def test_upstream_leaves_untouched(backend_cls, method):
    model = kron_friendly_mlp()
    z, y = _data()
    z.requires_grad_(True)
    x = torch.sigmoid(z)
    backend = backend_cls(model, "classification")
    out = method_calls(backend_cls)[method](backend, x, y)
    assert z.grad is None
    if method == "jacobians":  # still differentiable w.r.t. z afterwards
        (g,) = torch.autograd.grad(out[0].sum(), z)
        assert torch.isfinite(g).all() and g.abs().sum() > 0
        assert z.grad is None


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.__name__)
def test_train_mode_unchanged(backend_cls):
    model = kron_friendly_mlp().train()
    x, y = _data()
    backend = backend_cls(model, "classification")
    for call in method_calls(backend_cls).values():
        call(backend, x, y)
        assert all(m.training for m in model.modules())


@pytest.mark.parametrize(("backend_cls", "method"), METHOD_CASES, ids=IDS)
def test_user_hooks_stay_and_fire(backend_cls, method):
    model = kron_friendly_mlp()
    seen = []
    handle = model[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    backend = backend_cls(model, "classification")
    x, y = _data()
    method_calls(backend_cls)[method](backend, x, y)
    assert seen, "the user's hook must still fire during our forward pass"
    seen.clear()
    model(x)
    assert seen == [torch.Size([4, 5])]
    handle.remove()


@pytest.mark.parametrize(("backend_cls", "method"), METHOD_CASES, ids=IDS)
def test_other_extended_models_keep_their_backpack_hooks(backend_cls, method):
    other = extend(kron_friendly_mlp())
    mine = kron_friendly_mlp()
    backend = backend_cls(mine, "classification")
    x, y = _data()
    method_calls(backend_cls)[method](backend, x, y)

    x_user = x.clone().requires_grad_(True)  # BackPACK warns for inputs without grad
    loss = torch.nn.functional.cross_entropy(other(x_user), y, reduction="sum")
    with backpack(BatchGrad()):
        loss.backward()
    assert all(hasattr(p, "grad_batch") for p in other.parameters())


@pytest.mark.parametrize(("backend_cls", "method"), METHOD_CASES, ids=IDS)
def test_user_extended_model_still_works(backend_cls, method):
    """A model the user extended keeps its hooks; our results are not doubled."""
    model = extend(kron_friendly_mlp())
    reference = kron_friendly_mlp()
    x, y = _data()
    if backend_cls is DiffFuncGGN:  # torch.func cannot trace backward hooks
        with pytest.raises(UnsupportedModuleError, match="DiffBackPackGGN"):
            method_calls(backend_cls)[method](
                backend_cls(model, "classification"), x, y
            )
        return
    ours = method_calls(backend_cls)[method](backend_cls(model, "classification"), x, y)
    ref = method_calls(backend_cls)[method](
        backend_cls(reference, "classification"), x, y
    )
    for a, b in zip(_flat(ours), _flat(ref)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())
    x_user = x.clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(model(x_user), y, reduction="sum")
    with backpack(BatchGrad()):
        loss.backward()
    assert all(hasattr(p, "grad_batch") for p in model.parameters())


def _flat(result):
    if isinstance(result, torch.Tensor):
        return [result.detach()]
    if hasattr(result, "kfacs"):
        return [f.detach() for fs in result.kfacs for f in fs]
    return [t for r in result for t in _flat(r)]
