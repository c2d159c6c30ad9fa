"""The main paths on every available device (CPU always, CUDA when present).

Each path runs on the device and is compared with the float64 CPU reference, so a
missing ``.to(device)`` or a CPU-only tensor created on the way fails here. On a
machine without a GPU only the CPU case runs; CI's GPU runs add the CUDA case.
"""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac import (
    ContextPosterior,
    DiffBackPackGGN,
    DiffFuncGGN,
    ntk,
    optimize_locations,
)
from tests.conftest import CASES
from tests.references import reference_jacobians

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
