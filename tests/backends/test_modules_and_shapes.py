"""Contracts 6 and 7: layouts laplace-torch uses, and every BatchGrad module."""

from __future__ import annotations

import pytest
import torch
from laplace.utils import FeatureExtractor
from torch import nn

from laplace_diffjac import (
    DiffBackPackEF,
    DiffBackPackGGN,
    DiffFuncGGN,
    UnsupportedModuleError,
)
from tests.references import (
    assert_same_state,
    loop_jacobians,
    model_state,
    reference_jacobians,
)


def _check_against_reference(model, x, backend_cls=DiffBackPackGGN):
    """J equals the per-sample autograd loop (and ``vmap(jacrev)``), and so do the
    gradients of a function of J with respect to the input (when it is floating)
    and to the parameters."""
    model = model.double().eval()
    x = x.double() if x.is_floating_point() else x
    J, f = backend_cls(model, "classification").jacobians(x)
    J_ref, f_ref = loop_jacobians(model, x)
    J_ref, f_ref = J_ref.detach(), f_ref.detach()
    torch.testing.assert_close(
        J_ref, reference_jacobians(model, x)[0], rtol=1e-10, atol=1e-12
    )
    assert J.shape == (
        x.shape[0],
        f_ref.shape[1],
        sum(p.numel() for p in model.parameters()),
    )
    torch.testing.assert_close(J, J_ref, rtol=1e-10, atol=1e-12)

    leaves = list(model.parameters())
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
        leaves.append(x)
    weights = torch.randn_like(J_ref)
    J, _ = backend_cls(model, "classification").jacobians(x, enable_backprop=True)
    J_ref, _ = loop_jacobians(model, x)
    grads = _grads((weights * J * J).sum(), leaves)
    grads_ref = _grads((weights * J_ref * J_ref).sum(), leaves)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-11)


def _grads(scalar, leaves):
    """Gradients, zeros where a leaf does not influence ``scalar``."""
    grads = torch.autograd.grad(scalar, leaves, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, leaves)]


MODULE_CASES = {
    "conv1d-maxpool": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Flatten(),
            nn.Linear(3 * 4, 2),
        ),
        (2, 8),
    ),
    "conv2d-stride-dilation-groups": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, stride=2, dilation=1, groups=2),
            nn.ELU(),
            nn.Flatten(),
            nn.Linear(4 * 3 * 3, 3),
        ),
        (2, 7, 7),
    ),
    "conv2d-closed-form-stride-dilation-padding": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, stride=2, dilation=2, padding=1),
            nn.Tanh(),
            nn.Conv2d(3, 2, (2, 3), padding=(1, 0), bias=False),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * 2 * 1, 3),
        ),
        (2, 9, 9),
    ),
    "conv3d-avgpool": (
        lambda: nn.Sequential(
            nn.Conv3d(1, 2, 2),
            nn.Sigmoid(),
            nn.AvgPool3d(2),
            nn.Flatten(),
            nn.Linear(16, 2),
        ),
        (1, 5, 5, 5),
    ),
    "convtranspose1d": (
        lambda: nn.Sequential(
            nn.ConvTranspose1d(2, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 6, 2)
        ),
        (2, 4),
    ),
    "convtranspose2d": (
        lambda: nn.Sequential(
            nn.ConvTranspose2d(1, 2, 2, stride=2),
            nn.LeakyReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(8, 3),
        ),
        (1, 3, 3),
    ),
    "convtranspose3d": (
        lambda: nn.Sequential(
            nn.ConvTranspose3d(1, 1, 2), nn.SELU(), nn.Flatten(), nn.Linear(27, 2)
        ),
        (1, 2, 2, 2),
    ),
    "batchnorm2d-dropout-eval": (
        lambda: nn.Sequential(
            nn.Conv2d(1, 2, 3),
            nn.BatchNorm2d(2),
            nn.Dropout2d(0.5),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(2 * 3 * 3, 2),
        ),
        (1, 5, 5),
    ),
    "linear-no-bias-gelu-softplus": (
        lambda: nn.Sequential(
            nn.Linear(3, 4, bias=False),
            nn.GELU(),
            nn.Linear(4, 4),
            nn.Softplus(),
            nn.Linear(4, 2),
        ),
        (3,),
    ),
    "linear-on-sequences": (
        lambda: nn.Sequential(
            nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Flatten(), nn.Linear(10, 2)
        ),
        (5, 3),
    ),
    "custom-parameter-free-ops": (
        lambda: _Residual(),
        (3,),
    ),
}


class _Residual(nn.Module):
    """A non-Sequential model with a skip connection and a shared layer."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.shared = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + torch.sin(self.shared(h))
        h = h * torch.sigmoid(self.shared(h))  # the shared layer is called twice
        return self.out(h)


@pytest.mark.parametrize("name", list(MODULE_CASES))
def test_modules_batchgrad_supports(name):
    make, shape = MODULE_CASES[name]
    torch.manual_seed(0)
    model = make()
    if name.startswith("batchnorm"):
        with torch.no_grad():
            model[1].running_mean.uniform_(-1, 1)
            model[1].running_var.uniform_(0.5, 2)
    x = torch.randn(5, *shape)  # more samples than outputs
    _check_against_reference(model, x)


def test_embedding_with_integer_inputs_and_enable_backprop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 4), nn.Flatten(), nn.Tanh(), nn.Linear(8, 3))
    model = model.double().eval()
    x = torch.tensor([[1, 2], [3, 3], [6, 0]])
    J, f = DiffBackPackGGN(model, "classification").jacobians(x, enable_backprop=True)
    J_ref, _ = loop_jacobians(model, x)
    torch.testing.assert_close(J, J_ref, rtol=1e-10, atol=1e-12)
    (g,) = torch.autograd.grad(J.sum(), model[3].weight)  # still graph-connected
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN])
@pytest.mark.parametrize("n_out", [1, 4])
def test_single_and_many_outputs_without_output_size(backend_cls, n_out):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, n_out)).double()
    assert not hasattr(model, "output_size")
    x = torch.randn(6, 3, dtype=torch.float64)
    J, f = backend_cls(model, "regression").jacobians(x)
    assert J.shape == (6, n_out, 5 * 3 + 5 + n_out * 5 + n_out)
    assert f.shape == (6, n_out)
    assert not hasattr(model, "output_size")


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN])
def test_subnetwork_indices(backend_cls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    idx = torch.tensor([0, 4, 17, 20, 31])
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    backend = backend_cls(model, "regression", subnetwork_indices=idx)
    J, _ = backend.jacobians(x, enable_backprop=True)
    J_ref, _ = loop_jacobians(model, x)
    torch.testing.assert_close(J, J_ref[..., idx], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN])
def test_last_layer_jacobians_stay_connected(backend_cls):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    model = FeatureExtractor(net, last_layer_name="2")
    before = model_state(model)
    backend = backend_cls(model, "regression", last_layer=True)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    J, f = backend.last_layer_jacobians(x, enable_backprop=True)
    (g,) = torch.autograd.grad((J**2).sum() + f.sum(), x)
    assert_same_state(before, model_state(model))

    x_ref = x.detach().clone().requires_grad_(True)
    J_ref, f_ref = loop_jacobians(net, x_ref, list(net[2].parameters()))
    (g_ref,) = torch.autograd.grad((J_ref**2).sum() + f_ref.sum(), x_ref)
    torch.testing.assert_close(J, J_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)
    assert x.grad is None


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffBackPackEF])
def test_last_layer_backend_jacobians_equal_last_layer_jacobians(backend_cls):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    model = FeatureExtractor(net, last_layer_name="2")
    backend = backend_cls(model, "regression", last_layer=True)
    x = torch.randn(4, 3, dtype=torch.float64)
    J, _ = backend.jacobians(x)
    J_ll, _ = backend.last_layer_jacobians(x)
    torch.testing.assert_close(J, J_ll, rtol=1e-12, atol=1e-14)


class _BilinearNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.mix = nn.Bilinear(2, 2, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(self.mix(h[:, :2], h[:, 2:])))


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffBackPackEF])
def test_module_without_a_rule_takes_the_local_rule_mid_model(backend_cls):
    torch.manual_seed(0)
    model = _BilinearNet().double()
    before = model_state(model)
    x = torch.randn(5, 3, dtype=torch.float64)  # B != C
    J, _ = backend_cls(model, "regression").jacobians(x)
    assert_same_state(before, model_state(model))
    J_ref = loop_jacobians(model, x)[0].detach()
    torch.testing.assert_close(J, J_ref, rtol=1e-10, atol=1e-12)


class _BiasKVNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, add_bias_kv=True, batch_first=True)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.attn(x, x, x, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffBackPackEF])
def test_unsupported_module_is_named_and_model_untouched(backend_cls):
    torch.manual_seed(0)
    model = _BiasKVNet().double().eval()
    before = model_state(model)
    backend = backend_cls(model, "regression")
    x = torch.randn(5, 3, 4, dtype=torch.float64)  # B != C
    with pytest.raises(
        UnsupportedModuleError, match=r"attn \(MultiheadAttention.*DiffFuncGGN"
    ):
        backend.jacobians(x)
    assert_same_state(before, model_state(model))
    J, _ = DiffFuncGGN(model, "regression").jacobians(x)  # the way out works
    J_ref = loop_jacobians(model, x)[0].detach()
    torch.testing.assert_close(J, J_ref, rtol=1e-10, atol=1e-12)


def test_batchnorm_in_train_mode_is_refused_clearly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    with pytest.raises(UnsupportedModuleError, match="model.eval()"):
        DiffBackPackGGN(model, "regression").jacobians(torch.randn(5, 3).double())


def test_functorch_backend_takes_dict_inputs():
    class DictModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.lin = nn.Linear(3, 2)

        def forward(self, batch):
            h = self.emb(batch["input_ids"]).mean(1) * batch["scale"]
            return self.lin(torch.tanh(h))

    torch.manual_seed(0)
    model = DictModel().double()
    x = {
        "input_ids": torch.tensor([[1, 2], [0, 4], [3, 3]]),
        "scale": torch.rand(3, 1, dtype=torch.float64, requires_grad=True),
    }
    J, f = DiffFuncGGN(model, "classification").jacobians(x, enable_backprop=True)
    assert J.shape == (3, 2, 5 * 3 + 2 * 3 + 2)
    rows = []
    for n in range(3):
        xn = {k: v[n : n + 1] for k, v in x.items()}
        jac = torch.autograd.functional.jacobian(
            lambda *ps, xn=xn: torch.func.functional_call(
                model, dict(zip([k for k, _ in model.named_parameters()], ps)), (xn,)
            )[0],
            tuple(model.parameters()),
        )
        rows.append(torch.cat([j.flatten(1) for j in jac], 1))
    torch.testing.assert_close(J.detach(), torch.stack(rows), rtol=1e-10, atol=1e-12)
    (g,) = torch.autograd.grad(J.pow(2).sum(), x["scale"])
    assert torch.isfinite(g).all() and g.abs().sum() > 0
