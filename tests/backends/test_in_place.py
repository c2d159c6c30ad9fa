"""In-place activations and residual additions (torchvision's blocks) in every method.

Jacobians through them are audited (``audit_cases``: ``BasicBlock-in-place``,
``Bottleneck-in-place-downsample``); here every curvature method either works,
equal to the out-of-place model's, or refuses with a named reason and a route that
works, never a raw ``RuntimeError``, and the model keeps its flags and state.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchvision.models.resnet import BasicBlock

from laplace_diffjac import (
    DiffBackPackEF,
    DiffBackPackGGN,
    DiffFuncGGN,
    UnsupportedModuleError,
)
from tests.backends.methods import method_calls
from tests.references import assert_same_state, loop_jacobians, model_state

BACKENDS = [DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN]


class _ResNetLike(nn.Module):
    """torchvision's ResNet in small: in-place ReLU, a BasicBlock, torch.flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU(inplace=True)
        )
        self.block = BasicBlock(2, 2)
        self.fc = nn.Linear(2 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.block(self.stem(x)), 1))


def _resnet_like() -> nn.Module:
    torch.manual_seed(0)
    model = _ResNetLike().double().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return model


def _sequential(inplace: bool, activations: tuple = (nn.ReLU, nn.ReLU)) -> nn.Module:
    """A chain BackPACK's second-order extensions follow, with in-place modules."""
    torch.manual_seed(0)
    widths = (3, 5, 4, 4)
    layers: list[nn.Module] = []
    for n_in, n_out, act in zip(widths, widths[1:], activations):
        layers += [nn.Linear(n_in, n_out), act(inplace=inplace)]
    return nn.Sequential(*layers, nn.Linear(widths[len(activations)], 3)).double()


#: activations with an ``inplace`` flag that the engine's Jacobians go through
_ACTIVATIONS = (nn.ELU, nn.Hardswish, nn.LeakyReLU)


def _data(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, *shape, dtype=torch.float64, generator=gen)
    return x, torch.randint(0, 3, (5,), generator=gen)


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.__name__)
def test_residual_in_place_model_works_or_refuses_by_name(backend_cls):
    model = _resnet_like()
    x, y = _data((1, 3, 3))
    before = model_state(model)
    reference = DiffFuncGGN(model, "classification")
    for name, call in method_calls(backend_cls).items():
        try:
            result = call(backend_cls(model, "classification"), x, y)
        except UnsupportedModuleError as err:
            # BackPACK's hooks forbid `out += identity`; the route it names works
            assert backend_cls is not DiffFuncGGN and name in ("diag", "kron"), err
            assert "writes in place" in str(err) and "DiffFuncGGN" in str(err)
            if name == "diag":
                call(reference, x, y)
            continue
        finally:
            assert_same_state(before, model_state(model))
        if name == "full" and backend_cls is DiffBackPackGGN:
            torch.testing.assert_close(
                result[1], reference.full(x, y)[1], rtol=1e-10, atol=1e-12
            )
    assert all(m.inplace for m in model.modules() if hasattr(m, "inplace"))


def _curvature(backend, method, x, y):
    return backend.kron(x, y, N=10) if method == "kron" else backend.diag(x, y)


@pytest.mark.parametrize("method", ["diag", "kron"])
@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
def test_in_place_modules_give_the_out_of_place_curvature(backend_cls, method):
    model, plain = _sequential(inplace=True), _sequential(inplace=False)
    x, y = _data((3,))
    before = model_state(model)
    ours = _curvature(backend_cls(model, "classification"), method, x, y)
    ref = _curvature(backend_cls(plain, "classification"), method, x, y)
    assert_same_state(before, model_state(model))
    if method == "kron":
        for fs, fs_ref in zip(ours[1].kfacs, ref[1].kfacs):
            for a, b in zip(fs, fs_ref):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    else:
        torch.testing.assert_close(ours[1], ref[1], rtol=1e-12, atol=1e-14)
        diag_ref = DiffFuncGGN(plain, "classification").diag(x, y)[1]
        torch.testing.assert_close(ours[1], diag_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
def test_in_place_sequential_jacobians_match_the_loop(backend_cls):
    """Every activation of the chain works in place on a parameterised output."""
    model = _sequential(inplace=True, activations=_ACTIVATIONS)
    x, _ = _data((3,))
    J, f = backend_cls(model, "regression").jacobians(x)
    J_ref, f_ref = loop_jacobians(copy.deepcopy(model), x)
    torch.testing.assert_close(J, J_ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f, f_ref.detach(), rtol=1e-10, atol=1e-12)


def test_functional_flatten_between_modules_in_backpack_diag():
    """``torch.flatten`` between modules (BackPACK's extensions refused it)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)
            self.act = nn.Tanh()
            self.fc = nn.Linear(2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.flatten(self.act(self.conv(x)), 1))

    torch.manual_seed(0)
    model = Net().double()
    x, y = _data((1, 3, 3))
    _, diag = DiffBackPackGGN(model, "classification").diag(x, y)
    J, f = loop_jacobians(copy.deepcopy(model), x)
    p = torch.softmax(f, -1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    expected = torch.einsum("bcp,bck,bkp->p", J, lam, J).detach()
    torch.testing.assert_close(diag, expected, rtol=1e-10, atol=1e-13)


class _Keeper(nn.Module):
    """Keeps its output; the parent writes into it through that reference."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * self.weight
        self.kept[:] = [out]
        return out


class _WritesThroughKeeper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.keeper = _Keeper()
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.keeper(x)
        self.keeper.kept[0].mul_(2)
        return self.head(h)


def test_in_place_write_that_copies_cannot_catch_is_refused_by_name():
    torch.manual_seed(0)
    model = _WritesThroughKeeper().double()
    x, _ = _data((3,))
    with pytest.raises(UnsupportedModuleError, match=r"writes in place.*'keeper'"):
        DiffBackPackGGN(model, "regression").jacobians(x)
