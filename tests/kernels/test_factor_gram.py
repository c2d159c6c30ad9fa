"""The NTK from the engine's per-layer factors against the per-sample autograd loop.

Every module of the backends' module audit, plus class models (residual and
shared layers, a CNN, token inputs through attention, dict inputs): ``ntk`` and
``ntk_diag`` of ``DiffBackPackGGN`` (which contract the factors, never forming
``J``) equal ``J Σ₀ Jᵀ`` of :func:`tests.references.loop_jacobians` to 1e-10 in
float64, for scalar, per-layer and per-parameter priors; gradients with respect
to the input and the parameters equal central differences of the loop's Gram.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN, UnsupportedModuleError
from laplace_diffjac.kernels import ntk, ntk_diag
from laplace_diffjac.kernels._factor_gram import (
    factor_gram,
    gram_multiply_adds,
    jacobian_gram_multiply_adds,
)
from laplace_diffjac.kernels._ntk import factor_route_applies
from tests.backends.audit_cases import CASES
from tests.class_models import MODELS, built
from tests.references import central_difference, loop_jacobians

TOL = {"rtol": 1e-10, "atol": 1e-10}


def _loop_gram(model, x1, x2, prior_var):
    J1, _ = loop_jacobians(model, x1)
    J2, _ = loop_jacobians(model, x2)
    return torch.einsum("acp,p,bep->abce", J1.detach(), prior_var, J2.detach())


def _prior_vars(model: nn.Module) -> dict[str, torch.Tensor]:
    """Scalar, per-layer (one value per parameter tensor) and per-parameter."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(4)
    per_layer = torch.cat(
        [torch.full((p.numel(),), 0.5 + i / len(params)) for i, p in enumerate(params)]
    )
    return {
        "scalar": torch.tensor(0.7, dtype=torch.float64),
        "per-layer": per_layer.double(),
        "per-parameter": (0.5 + torch.rand(n, generator=gen)).double(),
    }


def _split(x):
    if isinstance(x, Mapping):
        return {k: v[:3] for k, v in x.items()}, {k: v[3:] for k, v in x.items()}
    return x[:3], x[3:]


def _check_gram(model, x) -> None:
    backend = DiffBackPackGGN(model, "regression")
    assert factor_route_applies(backend)
    x1, x2 = _split(x)
    for name, prior_var in _prior_vars(model).items():
        precision = prior_var.reciprocal()
        reference = _loop_gram(model, x1, x2, prior_var.expand(backend_columns(model)))
        with torch.no_grad():
            K = ntk(backend, x1, x2, prior_precision=precision, structured=True)
            Kd = ntk_diag(backend, x1, prior_precision=precision)
        torch.testing.assert_close(K, reference, **TOL, msg=name)
        own = _loop_gram(model, x1, x1, prior_var.expand(backend_columns(model)))
        diag = torch.diagonal(own, dim1=0, dim2=1).permute(2, 0, 1)
        torch.testing.assert_close(Kd, diag, **TOL, msg=name)


def backend_columns(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _weights(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(5)).double()


def _scalar_of_gram(K: torch.Tensor) -> torch.Tensor:
    """A fixed function of the Gram with non-trivial second derivatives."""
    return (_weights(K.shape) * K).sum() + (K * K).sum()


def _shifted(model, direction, t):
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p, d in zip(moved.parameters(), direction):
            p.add_(t * d)
    return moved


def _directions(model, leaves, seed: int) -> list[torch.Tensor]:
    """Random float64 directions for ``leaves`` (the parameters first), zero on
    embedding padding rows, whose gradient is zero by definition."""
    gen = torch.Generator().manual_seed(seed)
    direction = [torch.randn(v.shape, generator=gen).double() for v in leaves]
    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.padding_idx is not None:
            index = [i for i, p in enumerate(model.parameters()) if p is m.weight][0]
            direction[index][m.padding_idx] = 0
    return direction


def _check_gradients(model, x) -> None:
    """Gradients of a function of ``ntk(x, x2)`` in ``x`` and the parameters."""
    x1, x2 = _split(x)
    var = torch.tensor(0.7, dtype=torch.float64)
    columns = backend_columns(model)
    floating = isinstance(x1, torch.Tensor) and x1.is_floating_point()
    x_in = x1.clone().requires_grad_(True) if floating else x1
    K = ntk(DiffBackPackGGN(model, "regression"), x_in, x2, prior_precision=1 / var)
    leaves = list(model.parameters()) + ([x_in] if floating else [])
    grads = torch.autograd.grad(_scalar_of_gram(K), leaves, allow_unused=True)
    grads = [torch.zeros_like(v) if g is None else g for g, v in zip(grads, leaves)]
    direction = _directions(model, leaves, seed=6)
    u = direction.pop() if floating else None  # x's, checked on its own below
    along = sum((g * d).sum() for g, d in zip(grads, direction))

    def moved(t: float) -> torch.Tensor:
        shifted = _shifted(model, direction, t)
        return _scalar_of_gram(_loop_gram(shifted, x1, x2, var.expand(columns)))

    torch.testing.assert_close(along, central_difference(moved), rtol=1e-6, atol=1e-8)
    if floating:
        expected = central_difference(
            lambda t: _scalar_of_gram(
                _loop_gram(model, x1 + t * u, x2, var.expand(columns))
            )
        )
        torch.testing.assert_close(
            (grads[-1] * u).sum(), expected, rtol=1e-6, atol=1e-8
        )


def _refused(model: nn.Module, x: torch.Tensor) -> bool:
    try:
        DiffBackPackGGN(model, "regression").jacobians(x[:1])
    except UnsupportedModuleError:
        return True
    return False


@pytest.mark.parametrize("name", list(CASES))
def test_audited_module_gram_equals_loop_or_is_refused_alike(name: str) -> None:
    """Where the backend refuses a module (the audit checks why), so does ``ntk``."""
    case = CASES[name]
    model, x = case.model(), case.inputs()
    if not _refused(model, x):
        _check_gram(model, x)
        return
    with pytest.raises(UnsupportedModuleError):
        ntk(DiffBackPackGGN(model, "regression"), x, structured=True)


GRADIENT_CASES = [
    "Linear",
    "Conv2d",
    "Conv1d-circular-same",
    "LayerNorm",
    "BatchNorm2d",
    "Embedding",
    "MultiheadAttention",
    "TransformerEncoderLayer",
    "LSTM",
    "PReLU",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_audited_module_gram_gradients_equal_central_differences(name: str) -> None:
    case = CASES[name]
    _check_gradients(case.model(), case.inputs())


def _built(name: str):
    return built(name, 5)


@pytest.mark.parametrize("name", list(MODELS))
def test_class_model_gram_equals_loop(name: str) -> None:
    _check_gram(*_built(name))


@pytest.mark.parametrize("name", list(MODELS))
def test_class_model_gram_gradients_equal_central_differences(name: str) -> None:
    _check_gradients(*_built(name))


def test_float32_gram_within_1e_5_of_float64_loop() -> None:
    model64, x64 = _built("residual-shared")
    model32 = copy.deepcopy(model64).float()
    K = ntk(DiffBackPackGGN(model32, "regression"), x64.float(), structured=True)
    reference = _loop_gram(
        model64, x64, x64, torch.ones(backend_columns(model64)).double()
    )
    torch.testing.assert_close(K.double(), reference, rtol=1e-5, atol=1e-5)
    K64 = ntk(DiffBackPackGGN(model32, "regression"), x64.float(), dtype=torch.float64)
    assert K64.dtype == torch.float64
    torch.testing.assert_close(K64, reference, rtol=1e-5, atol=1e-5)


def test_factor_route_never_assembles_all_parameters(assembled_widths) -> None:
    """Only one parameter's block is ever written (for the block route)."""
    model, x = _built("cnn")
    ntk(DiffBackPackGGN(model, "regression"), x, structured=True)
    assert assembled_widths, "the convolutions' blocks should take the block route"
    assert all(n == 1 for n in assembled_widths)


def test_structured_true_refused_for_routes_without_factors() -> None:
    model, x = _built("residual-shared")
    with pytest.raises(ValueError, match="DiffBackPackGGN"):
        ntk(DiffFuncGGN(model, "regression"), x, structured=True)


def test_subnetwork_takes_the_jacobian_route_and_stays_right() -> None:
    model, x = _built("residual-shared")
    chosen = torch.tensor([0, 3, 17, 40, 60])
    backend = DiffBackPackGGN(model, "regression", subnetwork_indices=chosen)
    assert not factor_route_applies(backend)
    J, _ = loop_jacobians(model, x)
    J = J.detach()[..., chosen]
    with torch.no_grad():
        K = ntk(backend, x)
    torch.testing.assert_close(K, torch.einsum("acp,bep->abce", J, J), **TOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_cost_model_counts_the_multiply_adds_the_gram_runs(name: str) -> None:
    """``gram_multiply_adds`` against torch's FlopCounterMode (2 flops a multiply-add).

    The counter sees every matmul-like kernel the contraction runs; the cost model
    also counts the block route's elementwise writes (norm scales, Linear blocks
    without tokens, ``torch.mul``), which the counter does not: at most 10% more.
    The Jacobian route's count is above both (this model's layers favour factors).
    """
    model, x = _built(name)
    backend = DiffBackPackGGN(model, "regression")
    params = list(backend.params)
    prior_var = torch.tensor(0.7, dtype=torch.float64)
    with torch.no_grad():
        left, other = backend.jacobian_factors(x), backend.jacobian_factors(x)
        for right in (left, other, None):
            with FlopCounterMode(display=False) as counter:
                factor_gram(left, right, params, prior_var)
            counted = counter.get_total_flops()
            modelled = 2 * gram_multiply_adds(left, right, params, prior_var)
            assert counted <= modelled <= 1.1 * counted, (right is None, right is left)
            assert jacobian_gram_multiply_adds(left, right, params) > modelled / 2


class _FewPositionsCNN(nn.Module):
    """A second convolution with 4 output positions and many weights per position:
    its factor Gram is cheaper than its block's, so the factor route takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.head = nn.Linear(16 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        return self.head(torch.tanh(self.conv2(h)).flatten(1))


def _few_positions_cnn():
    torch.manual_seed(3)
    model = _FewPositionsCNN().double().eval()
    x = torch.randn(
        5, 1, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    return model, x


@pytest.mark.parametrize("name", ["few-positions-cnn", "token-transformer"])
def test_gram_in_chunks_of_one_sample_equals_loop(name: str, monkeypatch) -> None:
    """Products over positions contract batch 2 in chunks; one sample each here."""
    from laplace_diffjac.kernels import _factor_gram

    build = _few_positions_cnn if name == "few-positions-cnn" else lambda: _built(name)

    monkeypatch.setattr(_factor_gram, "_CHUNK_ELEMENTS", 1)
    calls = []
    chunked = _factor_gram._chunked_product_gram

    def counted(g1, inputs, g2, symmetric=False):
        calls.append((g2.shape[0], symmetric))
        return chunked(g1, inputs, g2, symmetric)

    monkeypatch.setattr(_factor_gram, "_chunked_product_gram", counted)
    _check_gram(*build())
    _check_gradients(*build())
    _check_symmetric_gram(*build())
    assert any(n > 1 and not sym for n, sym in calls)  # ran, over several chunks
    assert any(n > 1 and sym for n, sym in calls)  # and only its lower triangle


@pytest.mark.parametrize("prior", ["scalar", "per-layer", "per-parameter"])
def test_symmetric_gram_equals_loop_with_gradients_in_one_chunk(prior: str) -> None:
    """``ntk(x)`` without chunking, every prior: the blocks of both routes and of
    each prior value are summed in place (one sum per prior value)."""
    model, x = _few_positions_cnn()
    _check_symmetric_gram(model, x, _prior_vars(model)[prior])


def _check_symmetric_gram(model, x, var: torch.Tensor | None = None) -> None:
    """``ntk(x)`` (batch 2 is batch 1) and its gradients in the parameters and x."""
    var = torch.tensor(0.7, dtype=torch.float64) if var is None else var
    columns = var.expand(backend_columns(model))
    floating = isinstance(x, torch.Tensor) and x.is_floating_point()
    x_in = x.clone().requires_grad_(True) if floating else x
    K = ntk(DiffBackPackGGN(model, "regression"), x_in, prior_precision=1 / var)
    torch.testing.assert_close(K.detach(), _loop_gram(model, x, x, columns), **TOL)
    leaves = list(model.parameters()) + ([x_in] if floating else [])
    grads = torch.autograd.grad(_scalar_of_gram(K), leaves, allow_unused=True)
    grads = [torch.zeros_like(v) if g is None else g for g, v in zip(grads, leaves)]
    direction = _directions(model, leaves, seed=7)
    along = sum((g * d).sum() for g, d in zip(grads, direction))

    def moved(t: float) -> torch.Tensor:
        shifted = _shifted(model, direction, t)  # zips the parameters' directions
        x_t = x + t * direction[-1] if floating else x
        return _scalar_of_gram(_loop_gram(shifted, x_t, x_t, columns))

    # A small step: the moves of the parameters and x together cross a ReLU's
    # kink within 1e-5 for one of these priors' directions.
    expected = central_difference(moved, step=1e-6)
    torch.testing.assert_close(along, expected, rtol=1e-6, atol=1e-8)
