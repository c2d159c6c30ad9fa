"""The main paths on every available device (CPU always, CUDA when present).

Each path runs on the device and is compared with the float64 CPU reference (or
with the same computation on the CPU), so a missing ``.to(device)`` or a CPU-only
tensor created on the way fails here. On a machine without a GPU only the CPU case
runs; a GPU run (``benchmarks/gpu/run_on_gpu.py``) adds the CUDA case.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import pytest
import torch

from laplace_diffjac import (
    ContextPosterior,
    DiffBackPackGGN,
    DiffFuncGGN,
    ntk,
    optimize_locations,
)
from tests.class_models import built
from tests.conftest import CASES
from tests.references import loop_jacobians, reference_jacobians

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MLP = CASES[1]  # mlp-C3


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
def test_jacobians_and_their_gradients_on_device(device, backend_cls):
    model, x = MLP.model(), MLP.inputs(5)
    ref_J, ref_f = reference_jacobians(model, x.requires_grad_())
    (ref_g,) = torch.autograd.grad(ref_J.square().sum(), x)
    model_d = MLP.model().to(device)
    x_d = x.detach().to(device).requires_grad_()
    J, f = backend_cls(model_d, "regression").jacobians(x_d, enable_backprop=True)
    (g,) = torch.autograd.grad(J.square().sum(), x_d)
    assert J.device.type == device.type and g.device.type == device.type
    torch.testing.assert_close(J.cpu(), ref_J.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f.detach().cpu(), ref_f.detach(), rtol=1e-10, atol=0)
    torch.testing.assert_close(g.cpu(), ref_g, rtol=1e-10, atol=1e-12)


def test_kernel_on_device(device):
    model, x = MLP.model(), MLP.inputs(4)
    ref_J, _ = reference_jacobians(model, x)
    ref = torch.einsum("acp,bep->abce", ref_J, ref_J) / 2.0
    model_d = MLP.model().to(device)
    backend = DiffBackPackGGN(model_d, "regression")
    K = ntk(backend, x.to(device), prior_precision=2.0)
    torch.testing.assert_close(K.cpu(), ref, rtol=1e-10, atol=1e-12)


def test_locations_and_context_posterior_on_device(device):
    """The same run on the device and on the CPU gives the same numbers."""
    x = MLP.inputs(40, seed=3)
    results = {}
    for where in ("cpu", device.type):
        model = MLP.model().to(where)
        opt = optimize_locations(
            model, "regression", x.to(where), m=4, steps=3, progress_bar=False
        )
        cp = ContextPosterior(model, "regression", opt.locations).fit(x.to(where))
        mean, var = cp(x[:5].to(where))
        assert opt.locations.device.type == where and var.device.type == where
        results[where] = (opt.locations.cpu(), mean.cpu(), var.cpu())
    for a, b in zip(results["cpu"], results[device.type]):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def _to(x, device):
    if isinstance(x, Mapping):
        return {k: v.to(device) for k, v in x.items()}
    return x.to(device)


@pytest.mark.parametrize("name", ["residual-shared", "cnn", "token-transformer"])
def test_factor_route_kernel_and_its_gradient_on_device(device, name):
    """``ntk``'s per-layer factor route (class models: shared layers, convolutions,
    embeddings and attention) against the loop reference, and its gradient in the
    inputs (in the parameters for tokens) against the same step on the CPU."""
    model, x = built(name, 4)
    ref_J, _ = loop_jacobians(model, x)
    ref = torch.einsum("acp,bep->abce", ref_J, ref_J).detach() / 2.0
    grads = {}
    for where in ("cpu", device.type):
        model_d = copy.deepcopy(model).to(where)
        x_d = _to(x, where)
        tokens = isinstance(x, Mapping) or not x.is_floating_point()
        leaves = list(model_d.parameters()) if tokens else [x_d.requires_grad_(True)]
        K = ntk(DiffBackPackGGN(model_d, "regression"), x_d, prior_precision=2.0)
        assert K.device.type == where
        torch.testing.assert_close(K.detach().cpu(), ref, rtol=1e-10, atol=1e-12)
        g = torch.autograd.grad(K.square().sum(), leaves, allow_unused=True)
        grads[where] = [None if t is None else t.cpu() for t in g]
    for a, b in zip(grads["cpu"], grads[device.type]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_curvature_on_device_equals_the_cpu(device, structure):
    """``DiffBackPackGGN``'s GGN curvature (what laplace-torch's ``fit`` calls)."""
    model, x = MLP.model(), MLP.inputs(6)
    y = torch.randn(6, model(x).shape[1], dtype=x.dtype)
    results = {}
    for where in ("cpu", device.type):
        backend = DiffBackPackGGN(copy.deepcopy(model).to(where), "regression")
        x_d, y_d = x.to(where), y.to(where)
        if structure == "kron":
            loss, H = backend.kron(x_d, y_d, N=len(y))
            H = [f for block in H.kfacs for f in block]
        else:
            loss, H = getattr(backend, structure)(x_d, y_d)
            H = [H]
        assert all(h.device.type == where for h in H)
        results[where] = [loss.cpu(), *(h.cpu() for h in H)]
    for a, b in zip(results["cpu"], results[device.type]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_the_default_compute_dtype_follows_the_device(device):
    """``compute_dtype='auto'``: float64 where the device runs it near float32's
    rate, else the model's float32, within float32's error of the CPU's float64."""
    from torch import nn

    from laplace_diffjac._device_arithmetic import default_compute_dtype

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2))
    x, test = torch.randn(30, 3), torch.randn(5, 3)
    on_cpu = ContextPosterior(model, "regression", x[:6], compute_dtype=torch.float64)
    _, reference = on_cpu.fit(x)(test)
    model_d = copy.deepcopy(model).to(device)
    posterior = ContextPosterior(model_d, "regression", x[:6].to(device))
    _, var = posterior.fit(x.to(device))(test.to(device))
    assert posterior._compute_dtype == (default_compute_dtype(device) or torch.float32)
    torch.testing.assert_close(var.cpu(), reference, rtol=1e-4, atol=1e-6)
