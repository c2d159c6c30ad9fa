"""The local rule: modules without a rule of their own, on the BackPACK backends.

The mirrored modules of other libraries are audited (``audit_cases``:
``HF-Conv1D``, ``ViT-like-embeddings``, ``hand-written-RMSNorm``); here what the
audit cannot hold: inputs shared by the batch, outputs computed from one another,
modules that are no per-sample function (refused by name), the factor route of
the NTK, and the model's state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN, UnsupportedModuleError
from laplace_diffjac.jacobians import parameter_jacobians
from laplace_diffjac.kernels import ntk
from tests.backends.audit_cases import HFConv1D, ViTLikeEmbeddings
from tests.references import (
    assert_same_state,
    central_difference,
    loop_jacobians,
    model_state,
)


class _MaskedMix(nn.Module):
    """Mixes positions through a shared ``(T, T)`` mask given as a keyword."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.einsum("st,btd->bsd", mask, x) * self.weight


class _StateAndOutput(nn.Module):
    """Returns ``(tanh(c), c)`` with ``c`` its pre-activation: dependent outputs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, width))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = x * self.weight
        return torch.tanh(c), c


class _Net(nn.Module):
    """A GPT-2-like stack: Conv1D, the mask mix, the two-output module, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = HFConv1D(4, 3)
        self.mix = _MaskedMix(4)
        self.cell = _StateAndOutput(4)
        self.head = nn.Linear(3 * 4, 3)
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, c = self.cell(self.mix(self.proj(x), mask=self.mask))
        return self.head((h * c + h).flatten(1))


def _gradient_along(model, x, backend_cls):
    """d/dt of ``Σ J²`` along a random input direction: autograd and the loop."""
    x_in = x.clone().requires_grad_(True)
    J, _ = backend_cls(model, "regression").jacobians(x_in, enable_backprop=True)
    (g,) = torch.autograd.grad(J.square().sum(), x_in)
    u = torch.randn_like(x)
    expected = central_difference(
        lambda t: loop_jacobians(model, x + t * u)[0].square().sum()
    )
    torch.testing.assert_close((g * u).sum(), expected, rtol=1e-6, atol=1e-8)


def test_shared_inputs_and_dependent_outputs():
    torch.manual_seed(0)
    model = _Net().double()
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    before = model_state(model)
    J, f = DiffBackPackGGN(model, "regression").jacobians(x)
    assert_same_state(before, model_state(model))
    J_ref, f_ref = loop_jacobians(model, x)
    torch.testing.assert_close(J, J_ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f, f_ref.detach(), rtol=1e-10, atol=1e-12)
    _gradient_along(model, x, DiffBackPackGGN)


def test_shared_input_as_long_as_the_batch_is_refused_by_name():
    """A (T, T) mask at B = T cannot be told from a batched input: a refusal."""
    torch.manual_seed(0)
    model = _Net().double()
    x = torch.randn(3, 3, 3, dtype=torch.float64)
    with pytest.raises(UnsupportedModuleError, match="_MaskedMix.*shared by the"):
        parameter_jacobians(model, x, list(model.parameters()))


class _BatchCentred(nn.Module):
    """A scale applied to the input minus the batch mean: couples the samples."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) * self.weight + x


class _Noisy(nn.Module):
    """A parameter and dropout of its own, in training mode: random."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x * self.weight)


@pytest.mark.parametrize("layer", [_BatchCentred, _Noisy])
def test_module_that_is_no_per_sample_function_is_refused_by_name(layer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), layer(4), nn.Linear(4, 2)).double()
    model.train(layer is _Noisy)
    x = torch.randn(5, 4, dtype=torch.float64)
    before = model_state(model)
    with pytest.raises(UnsupportedModuleError, match=layer.__name__) as err:
        DiffBackPackGGN(model, "regression").jacobians(x)
    assert "DiffFuncGGN" in str(err.value)
    assert_same_state(before, model_state(model))


class _ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = ViTLikeEmbeddings()
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embeddings(pixels))[:, 0])  # class token


def test_factor_route_of_the_ntk_takes_dense_blocks():
    torch.manual_seed(0)
    model = _ViT().double()
    x1 = torch.randn(4, 2, 4, 4, dtype=torch.float64)
    x2 = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    K = ntk(DiffBackPackGGN(model, "regression"), x1, x2, structured=False)
    J1, _ = loop_jacobians(model, x1)
    J2, _ = loop_jacobians(model, x2)
    expected = torch.einsum("acp,bep->abce", J1, J2).detach()
    torch.testing.assert_close(K, expected, rtol=1e-10, atol=1e-12)


def test_vit_like_model_matches_diff_func_ggn_with_gradients():
    torch.manual_seed(0)
    model = _ViT().double()
    x = torch.randn(5, 2, 4, 4, dtype=torch.float64)
    J, _ = DiffBackPackGGN(model, "regression").jacobians(x)
    J_func, _ = DiffFuncGGN(model, "regression").jacobians(x)
    torch.testing.assert_close(J, J_func, rtol=1e-10, atol=1e-12)
    _gradient_along(model, x, DiffBackPackGGN)
