"""Every parameterised ``torch.nn`` module on both Jacobian engines, at B != C.

Each module is either right (Jacobians and outputs equal the per-sample autograd
loop to 1e-10 in float64, and gradients of a function of them with respect to the
input and the parameters equal central differences of the loop's values), or
refused before any work, with an error that names the module and only sends the
user to a backend that passes this audit for it. ``DiffBackPackEF`` shares
``DiffBackPackGGN``'s Jacobians.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings

import pytest
import torch
from torch import nn

from laplace_diffjac import (
    DiffBackPackEF,
    DiffBackPackGGN,
    DiffFuncGGN,
    UnsupportedModuleError,
)
from tests.backends.audit_cases import (
    BATCH,
    CASES,
    MUST_BE_RIGHT,
    OUTPUTS,
    AuditNet,
    Case,
)
from tests.references import (
    assert_same_state,
    central_difference,
    loop_jacobians,
    model_state,
)

BACKENDS = {b.__name__: b for b in (DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN)}


def _audit(case: Case, backend_cls: type) -> UnsupportedModuleError | None:
    """``None`` if ``backend_cls`` is right on ``case``, its refusal otherwise."""
    model, x = case.model(), case.inputs()
    before = model_state(model)
    try:
        J, f = backend_cls(model, "regression").jacobians(x)
    except UnsupportedModuleError as err:
        if not case.refused_while_running:
            assert model.forward_calls == [0], "refused after running the model"
        assert_same_state(before, model_state(model))
        return err
    J_ref, f_ref = loop_jacobians(model, x)
    assert J.shape == (BATCH, OUTPUTS, sum(p.numel() for p in model.parameters()))
    torch.testing.assert_close(f, f_ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(J, J_ref.detach(), rtol=1e-10, atol=1e-10)
    _check_reference_first_derivatives(model, x, J_ref.detach())
    _check_gradients_through_jacobians(model, x, backend_cls)
    if hasattr(backend_cls, "gradients"):  # per-sample gradients, same engine
        y = torch.randn_like(f_ref)
        Gs, _ = backend_cls(model, "regression").gradients(x, y)
        residual = 2 * (f_ref - y).detach()  # of the summed squared error
        G_ref = torch.einsum("bc,bcp->bp", residual, J_ref.detach())
        torch.testing.assert_close(Gs, G_ref, rtol=1e-10, atol=1e-10)
    return None


def _directions(model: nn.Module) -> list[torch.Tensor]:
    """A random direction in parameter space, zero on Embedding padding rows.

    PyTorch defines the gradient of an Embedding's ``padding_idx`` row as zero
    (the row is not trained), although the output depends on it.
    """
    torch.manual_seed(2)
    direction = {id(p): torch.randn_like(p) for p in model.parameters()}
    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.padding_idx is not None:
            direction[id(m.weight)][m.padding_idx] = 0
    return [direction[id(p)] for p in model.parameters()]


def _shifted(model: nn.Module, direction: list[torch.Tensor], t: float):
    """A copy of ``model`` whose parameters moved by ``t * direction``."""
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p, d in zip(moved.parameters(), direction):
            p.add_(t * d)
    return moved


def _check_reference_first_derivatives(model, x, J_ref):
    """The loop's Jacobian along a parameter direction equals central differences."""
    direction = _directions(model)
    jvp = J_ref @ torch.cat([d.flatten() for d in direction])

    for c in range(OUTPUTS):

        def output_c(t, c=c):
            return _shifted(model, direction, t)(x)[:, c].sum()

        torch.testing.assert_close(
            jvp[:, c].sum(), central_difference(output_c), rtol=1e-6, atol=1e-8
        )


def _scalar(J: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """A fixed function of the Jacobians and outputs, with second derivatives."""
    torch.manual_seed(3)
    weights = torch.randn(J.shape, dtype=J.dtype)
    return (weights * J * J).sum() + (f * f).sum()


def _check_gradients_through_jacobians(model, x, backend_cls):
    """Gradients of ``_scalar(J, f)`` in the input and the parameters, against
    central differences of the loop's values."""
    floating = x.is_floating_point()
    x_in = x.clone().requires_grad_(True) if floating else x
    J, f = backend_cls(model, "regression").jacobians(x_in, enable_backprop=True)
    leaves = list(model.parameters()) + ([x_in] if floating else [])
    grads = torch.autograd.grad(_scalar(J, f), leaves, allow_unused=True)
    grads = [torch.zeros_like(v) if g is None else g for g, v in zip(grads, leaves)]

    direction = _directions(model)
    along = sum((g * d).sum() for g, d in zip(grads, direction))
    torch.testing.assert_close(
        along,
        central_difference(
            lambda t: _scalar(*loop_jacobians(_shifted(model, direction, t), x))
        ),
        rtol=1e-6,
        atol=1e-8,
    )
    if floating:
        u = torch.randn_like(x)
        torch.testing.assert_close(
            (grads[-1] * u).sum(),
            central_difference(lambda t: _scalar(*loop_jacobians(model, x + t * u))),
            rtol=1e-6,
            atol=1e-8,
        )


def _suggested(message: str, refusing: type) -> set[type]:
    named = set(
        re.findall(r"\b(DiffBackPackGGN|DiffBackPackEF|DiffFuncGGN)\b", message)
    )
    return {BACKENDS[n] for n in named} - {refusing}


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
@pytest.mark.parametrize("name", list(CASES))
def test_module_is_right_or_refused_with_a_working_route(name, backend_cls):
    case = CASES[name]
    refusal = _audit(case, backend_cls)
    if refusal is None:
        return
    message = str(refusal)
    assert name not in MUST_BE_RIGHT, message
    owners = {
        type(m).__name__
        for m in case.model().layer.modules()
        if next(m.parameters(recurse=False), None) is not None
    }
    assert any(owner in message for owner in owners), message
    for route in _suggested(message, backend_cls):
        assert _audit(case, route) is None, f"{message} sends to {route.__name__}"


def _parameterised_nn_classes() -> set[type]:
    """``torch.nn`` module classes with parameters once built with small sizes."""
    found = set()
    for name in dir(nn):
        cls = getattr(nn, name)
        if not inspect.isclass(cls) or not issubclass(cls, nn.Module):
            continue
        if issubclass(cls, nn.modules.loss._Loss):
            continue
        for args, kwargs in [((), {}), ((4,), {}), ((4, 4), {}), ((4, 4, 3), {})]:
            for extra in ({}, {"affine": True}):
                try:
                    with warnings.catch_warnings(record=True):  # lazy modules warn
                        module = cls(*args, **kwargs, **extra)
                except Exception:  # noqa: BLE001, S112 - a signature that does not fit
                    continue
                if any(True for _ in module.parameters()):
                    found.add(cls)
    return found


def test_audit_covers_every_parameterised_nn_module():
    audited = {type(m) for case in CASES.values() for m in case.model().modules()} - {
        AuditNet
    }
    missing = set()
    for cls in _parameterised_nn_classes():
        # lazy modules turn into their eager class at their first call
        cls = getattr(cls, "cls_to_become", None) or cls
        if cls not in audited:
            missing.add(cls.__name__)
    assert not missing
    composites = {nn.AdaptiveLogSoftmaxWithLoss, nn.TransformerEncoder}
    assert composites | {nn.TransformerDecoder, nn.RNNCell} <= audited


@pytest.mark.parametrize("batch", [2, 5], ids=["B=C", "B!=C"])
@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
def test_frozen_prelu_is_differentiated_through_rightly(backend_cls, batch):
    """A PReLU without trainable parameters still runs in its elementary form, so
    gradients through it are right at B == C and B != C."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.PReLU(4), nn.Linear(4, 2)).double()
    model[1].weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    x = torch.randn(batch, 3, dtype=torch.float64)
    x_in = x.clone().requires_grad_(True)
    J, f = backend_cls(model, "regression").jacobians(x_in, enable_backprop=True)
    J_ref, _ = loop_jacobians(model, x, trainable)
    torch.testing.assert_close(J, J_ref.detach(), rtol=1e-10, atol=1e-10)
    (g,) = torch.autograd.grad(_scalar(J, f), x_in)
    u = torch.randn_like(x)
    expected = central_difference(
        lambda t: _scalar(*loop_jacobians(model, x + t * u, trainable))
    )
    torch.testing.assert_close((g * u).sum(), expected, rtol=1e-6, atol=1e-8)
