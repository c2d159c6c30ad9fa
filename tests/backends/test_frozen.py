"""Frozen parameters (``requires_grad=False``): LoRA-style and partly frozen models.

Jacobians, gradients and curvature are taken over the trainable parameters only,
in ``backend.params`` order, and compared with float64 ``torch.func`` references
(and, for Kronecker factors, laplace-torch's own BackPACK/curvlinops backends).
The frozen parameters keep their ``requires_grad`` and ``.grad``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from laplace.curvature import BackPackGGN, CurvlinopsGGN
from laplace.utils import Kron
from torch import nn
from torch.func import functional_call, grad, vmap

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from tests.frozen_models import FROZEN_MODELS, lora_model, partly_frozen_mlp, trainable
from tests.laplace_integration.helpers import upstream_quiet
from tests.references import assert_same_state, model_state, reference_jacobians

BACKENDS = [DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN]
LIKELIHOODS = ["regression", "classification"]

models = pytest.mark.parametrize(
    "make_model", FROZEN_MODELS.values(), ids=FROZEN_MODELS
)
backends = pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
likelihoods = pytest.mark.parametrize("likelihood", LIKELIHOODS)


def _data(likelihood: str, n: int = 6):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    if likelihood == "regression":
        return x, torch.randn(n, 2, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=gen)


def _model(make_model, likelihood: str) -> nn.Module:
    return make_model(2 if likelihood == "regression" else 3)


def _loss(likelihood: str) -> nn.Module:
    if likelihood == "regression":
        return nn.MSELoss(reduction="sum")
    return nn.CrossEntropyLoss(reduction="sum")


def _reference_ggn(model, x, likelihood):
    """``factor * sum_n J_n^T H_n J_n`` over the trainable parameters."""
    Js, f = reference_jacobians(model, x, trainable(model))
    if likelihood == "regression":
        return 0.5 * 2.0 * torch.einsum("ncp,ncq->pq", Js, Js)
    p = f.softmax(-1)
    H = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("ncp,ncd,ndq->pq", Js, H, Js)


def _reference_gradients(model, x, y, likelihood):
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    lossfunc = _loss(likelihood)

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi[None],), strict=False)
        return lossfunc(out, yi[None])

    gs = vmap(grad(loss), in_dims=(None, 0, 0))(named, x, y)
    return torch.cat([g.flatten(start_dim=1) for g in gs.values()], dim=1)


def _guarded(model):
    """Give every frozen parameter a ``.grad`` to check it is left alone."""
    for p in model.parameters():
        if not p.requires_grad:
            p.grad = torch.full_like(p, 3.0)
    return [p.requires_grad for p in model.parameters()], model_state(model)


def _assert_untouched(model, flags, state):
    assert [p.requires_grad for p in model.parameters()] == flags
    assert_same_state(state, model_state(model))


@likelihoods
@backends
@models
def test_jacobians_over_trainable_parameters(make_model, backend, likelihood):
    model = _model(make_model, likelihood)
    x, _ = _data(likelihood)
    flags, state = _guarded(model)
    b = backend(model, likelihood)
    assert [id(p) for p in b.params] == [id(p) for p in trainable(model)]
    J_ref, f_ref = reference_jacobians(model, x, trainable(model))
    for enable_backprop in (False, True):
        Js, f = b.jacobians(x, enable_backprop=enable_backprop)
        torch.testing.assert_close(Js, J_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(f, f_ref, rtol=1e-10, atol=1e-10)
    _assert_untouched(model, flags, state)


@models
def test_jacobians_backprop_to_input(make_model):
    model = _model(make_model, "regression")
    x, _ = _data("regression")
    x = x.requires_grad_(True)
    Js, _ = DiffBackPackGGN(model, "regression").jacobians(x, enable_backprop=True)
    (g,) = torch.autograd.grad(Js.square().sum(), x)
    J_ref, _ = reference_jacobians(model, x, trainable(model))
    (g_ref,) = torch.autograd.grad(J_ref.square().sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


@likelihoods
@backends
@models
def test_gradients_over_trainable_parameters(make_model, backend, likelihood):
    model = _model(make_model, likelihood)
    x, y = _data(likelihood)
    flags, state = _guarded(model)
    Gs, loss = backend(model, likelihood).gradients(x, y)
    torch.testing.assert_close(
        Gs, _reference_gradients(model, x, y, likelihood), rtol=1e-10, atol=1e-10
    )
    torch.testing.assert_close(loss, _loss(likelihood)(model(x), y))
    _assert_untouched(model, flags, state)


@likelihoods
@pytest.mark.parametrize(
    "backend", [DiffBackPackGGN, DiffFuncGGN], ids=lambda b: b.__name__
)
@models
def test_full_and_diag_ggn(make_model, backend, likelihood):
    model = _model(make_model, likelihood)
    x, y = _data(likelihood)
    flags, state = _guarded(model)
    b = backend(model, likelihood)
    H_ref = _reference_ggn(model, x, likelihood)
    _, H = b.full(x, y)
    torch.testing.assert_close(H, H_ref, rtol=1e-8, atol=1e-10)
    _, diag = b.diag(x, y)  # LoRA's graph is not sequential: the engine's diag
    torch.testing.assert_close(diag, H_ref.diagonal(), rtol=1e-8, atol=1e-10)
    _assert_untouched(model, flags, state)


@likelihoods
@models
def test_empirical_fisher_diag(make_model, likelihood):
    model = _model(make_model, likelihood)
    x, y = _data(likelihood)
    flags, state = _guarded(model)
    _, diag = DiffBackPackEF(model, likelihood).diag(x, y)
    G = _reference_gradients(model, x, y, likelihood)
    factor = 0.5 if likelihood == "regression" else 1.0
    torch.testing.assert_close(diag, factor * G.square().sum(0), rtol=1e-8, atol=1e-10)
    _assert_untouched(model, flags, state)


def _assert_same_kron(actual, expected):
    assert len(actual.kfacs) == len(expected.kfacs)
    for fa, fe in zip(actual.kfacs, expected.kfacs):
        assert len(fa) == len(fe)
        for a, e in zip(fa, fe):
            torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-12)


@likelihoods
def test_kron_partly_frozen_equals_upstream_backpack(likelihood):
    model = partly_frozen_mlp(2 if likelihood == "regression" else 3)
    x, y = _data(likelihood)
    flags, state = _guarded(model)
    loss, kron = DiffBackPackGGN(model, likelihood).kron(x, y, N=10)
    loss_f, kron_f = DiffFuncGGN(model, likelihood).kron(x, y, N=10)
    _assert_untouched(model, flags, state)
    # Upstream refuses frozen parameters; a parameter's KFLR factors do not depend
    # on which others are trainable, so compare with its blocks on a thawed copy.
    thawed = copy.deepcopy(model).requires_grad_(True)
    with upstream_quiet():
        loss_u, kron_all = BackPackGGN(thawed, likelihood).kron(x, y, N=10)
    keep = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
    kron_u = Kron([kron_all.kfacs[i] for i in keep])
    assert len(kron.kfacs) == 3  # weight+bias of the head, one weight in between
    _assert_same_kron(kron, kron_u)
    _assert_same_kron(kron_f, kron_u)
    torch.testing.assert_close(loss, loss_u)
    torch.testing.assert_close(loss_f, loss_u)


@likelihoods
def test_kron_lora_equals_curvlinops(likelihood):
    model = lora_model(2 if likelihood == "regression" else 3)
    x, y = _data(likelihood)
    flags, state = _guarded(model)
    loss_u, kron_u = CurvlinopsGGN(copy.deepcopy(model), likelihood).kron(x, y, N=10)
    for backend in (DiffFuncGGN, DiffBackPackGGN):
        loss, kron = backend(model, likelihood).kron(x, y, N=10)
        _assert_untouched(model, flags, state)
        _assert_same_kron(kron, kron_u)
        torch.testing.assert_close(loss, loss_u)
