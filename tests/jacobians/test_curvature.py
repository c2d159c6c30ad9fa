"""The engine's curvature (``jacobians/_curvature``): diagonal, EF, Kronecker factors.

Every model of ``tests/class_models.py`` (residual and shared layers, a CNN with
``torch.flatten`` between modules, a token transformer, dict inputs, LayerNorm),
both likelihoods, against the float64 per-sample autograd loop: the GGN diagonal,
the empirical Fisher's diagonal, the exact blocks of ``kron`` where it keeps them
and the nearest Kronecker product (a dense SVD of the rearranged block) where no
KFAC rule applies. KFAC itself is checked against BackPACK and curvlinops in
``tests/backends``. Also: independent of batching and of the dtype.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, InvalidInputError
from laplace_diffjac.jacobians import _kronecker
from tests.class_models import MODELS, built
from tests.references import loop_jacobians

LIKELIHOODS = ["classification", "regression"]
models = pytest.mark.parametrize("name", list(MODELS))
likelihoods = pytest.mark.parametrize("likelihood", LIKELIHOODS)


def _targets(likelihood: str, n: int, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if likelihood == "classification":
        return torch.randint(0, 3, (n,), generator=gen)
    return torch.randn(n, 3, generator=gen, dtype=torch.float64)


def _lam(f: torch.Tensor, likelihood: str) -> torch.Tensor:
    """laplace-torch's GGN weight per sample: ``Λ`` times its ``factor``."""
    if likelihood == "regression":  # factor 1/2 times MSE's Hessian 2 I
        return torch.eye(f.shape[1], dtype=f.dtype).expand(f.shape[0], -1, -1)
    p = torch.softmax(f, -1)
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


def _loop_ggn(model: nn.Module, x, likelihood: str) -> torch.Tensor:
    J, f = loop_jacobians(model, x)
    return torch.einsum("bcp,bck,bkq->pq", J, _lam(f, likelihood), J).detach()


def _loop_gradients(model: nn.Module, x, y, likelihood: str) -> torch.Tensor:
    J, f = loop_jacobians(model, x)
    if likelihood == "regression":
        dloss = 2 * (f - y)
    else:
        dloss = torch.softmax(f, -1) - nn.functional.one_hot(y, 3).to(f.dtype)
    return torch.einsum("bc,bcp->bp", dloss, J).detach()


def _nearest_kronecker_product(H: torch.Tensor, m: int, n: int) -> torch.Tensor:
    R = H.reshape(m, n, m, n).permute(0, 2, 1, 3).reshape(m * m, n * n)
    U, S, Vh = torch.linalg.svd(R)
    return S[0] * torch.kron(U[:, 0].reshape(m, m), Vh[0].reshape(n, n))


@likelihoods
@models
def test_diagonal_equals_the_loop_ggn(name, likelihood):
    model, x = built(name, 5)
    y = _targets(likelihood, 5)
    _, diag = DiffBackPackGGN(model, likelihood).diag(x, y)
    expected = _loop_ggn(model, x, likelihood).diagonal()
    torch.testing.assert_close(diag, expected, rtol=1e-10, atol=1e-13)


@likelihoods
@models
def test_empirical_fisher_diagonal_equals_the_loop(name, likelihood):
    model, x = built(name, 5)
    y = _targets(likelihood, 5)
    _, diag = DiffBackPackEF(model, likelihood).diag(x, y)
    factor = 0.5 if likelihood == "regression" else 1.0
    expected = factor * _loop_gradients(model, x, y, likelihood).square().sum(0)
    torch.testing.assert_close(diag, expected, rtol=1e-10, atol=1e-13)


#: Owners whose biases are KFAC's weights of input 1 (not exact over tokens).
_KFAC_OWNERS = (nn.Linear, nn.Embedding, nn.MultiheadAttention, nn.RNNBase)


@likelihoods
@pytest.mark.parametrize("name", ["cnn", "layer-norm", "token-transformer"])
def test_kron_keeps_exact_blocks_of_other_parameters(name, likelihood):
    """One-dimensional parameters without a KFAC rule (norms, conv biases): the
    loop's block."""
    model, x = built(name, 5)
    y = _targets(likelihood, 5)
    _, kron = DiffBackPackGGN(model, likelihood).kron(x, y, N=5)
    H = _loop_ggn(model, x, likelihood)
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    start, checked = 0, 0
    for p, factors in zip(model.parameters(), kron.kfacs):
        block = H[start : start + p.numel(), start : start + p.numel()]
        start += p.numel()
        if p.dim() == 1 and not isinstance(owners[id(p)], _KFAC_OWNERS):
            floor = 1e-13 * block.abs().max()
            torch.testing.assert_close(factors[0], block, rtol=1e-10, atol=floor)
            checked += 1
    assert checked > 0


def test_nearest_kronecker_product_power_method_equals_the_svd(monkeypatch):
    """Past ``_DENSE_ELEMENTS`` the power method takes over: the same product."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Bilinear(4, 4, 2)).double()

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.body[0](x))
            return self.body[2](h, h)

    net = Twice()
    x = torch.randn(6, 3, dtype=torch.float64)
    y = _targets("regression", 6)[:, :2]
    bilinear = net.body[2].weight  # (2, 4, 4): no KFAC rule, F0 is 2×2
    index = [id(p) for p in net.parameters()].index(id(bilinear))
    H = _loop_ggn(net, x, "regression")
    start = sum(p.numel() for p in list(net.parameters())[:index])
    block = H[start : start + bilinear.numel(), start : start + bilinear.numel()]
    expected = _nearest_kronecker_product(block, 2, 16)
    dense = DiffBackPackGGN(net, "regression").kron(x, y, N=6)[1].kfacs[index]
    torch.testing.assert_close(torch.kron(*dense), expected, rtol=1e-9, atol=1e-12)
    monkeypatch.setattr(_kronecker, "_DENSE_ELEMENTS", 0)
    power = DiffBackPackGGN(net, "regression").kron(x, y, N=6)[1].kfacs[index]
    torch.testing.assert_close(torch.kron(*power), expected, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("method", ["diag", "kron"])
@models
def test_curvature_is_independent_of_batching(name, method):
    """Two halves summed equal the whole batch (kron: its exact blocks)."""
    model, x = built(name, 6)
    y = _targets("classification", 6)
    backend = DiffBackPackGGN(model, "classification")

    def part(rows):
        xs = {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]
        if method == "diag":
            return backend.diag(xs, y[rows])
        return backend.kron(xs, y[rows], N=6)

    whole, first, second = part(slice(0, 6)), part(slice(0, 4)), part(slice(4, 6))
    torch.testing.assert_close(first[0] + second[0], whole[0], rtol=1e-12, atol=0)
    if method == "diag":
        floor = 1e-14 * whole[1].abs().max()  # attention's key bias: round-off
        torch.testing.assert_close(
            first[1] + second[1], whole[1], rtol=1e-11, atol=floor
        )
        return
    for p, a, b, w in zip(
        model.parameters(), first[1].kfacs, second[1].kfacs, whole[1].kfacs
    ):
        if p.dim() == 1:
            floor = 1e-14 * w[0].abs().max()
            torch.testing.assert_close(a[0] + b[0], w[0], rtol=1e-11, atol=floor)


@models
def test_float32_curvature_is_float64s(name):
    model, x = built(name, 5)
    y = _targets("classification", 5)
    _, diag64 = DiffBackPackGGN(model, "classification").diag(x, y)
    model32 = model.float()
    x32 = (
        {k: v.float() for k, v in x.items()}
        if isinstance(x, dict)
        else (x.float() if x.is_floating_point() else x)
    )
    _, diag32 = DiffBackPackGGN(model32, "classification").diag(x32, y)
    assert diag32.dtype == torch.float32
    torch.testing.assert_close(diag32.double(), diag64, rtol=1e-4, atol=1e-6)


def test_unknown_kfac_setting_is_named():
    model, x = built("residual-shared", 3)
    with pytest.raises(InvalidInputError, match="'expand' or 'reduce'"):
        DiffBackPackGGN(model, "classification", kfac_approx="mean")
    backend = DiffBackPackGGN(model, "classification")
    with pytest.raises(InvalidInputError, match="'expand' or 'reduce'"):
        backend.kron(x, _targets("classification", 3), N=3, kfac_approx="mean")


@pytest.mark.parametrize("scale", [1.0, 1e-14])
def test_nearest_kronecker_product_in_float32_and_at_tiny_scales(monkeypatch, scale):
    """The power method in float32, with Jacobians of ~1e-13 (MobileNetV3's
    depthwise convolutions): the float64 product, no NaN, no 1,000 iterations."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, groups=4)  # depthwise: no KFAC rule
    net = nn.Sequential(conv, nn.Flatten(), nn.Linear(16, 2)).double()
    with torch.no_grad():
        net[2].weight.mul_(scale)
    x = torch.randn(5, 4, 4, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    H = _loop_ggn(net, x, "classification")
    block = H[: conv.weight.numel(), : conv.weight.numel()]
    expected = _nearest_kronecker_product(block, 4, 9)
    monkeypatch.setattr(_kronecker, "_DENSE_ELEMENTS", 0)
    calls = []
    original = _kronecker._power_method
    monkeypatch.setattr(
        _kronecker, "_power_method", lambda rows: calls.append(1) or original(rows)
    )
    _, kron = DiffBackPackGGN(net.float(), "classification").kron(x.float(), y, N=5)
    got = torch.kron(*kron.kfacs[0]).double()
    assert calls and torch.isfinite(got).all()
    torch.testing.assert_close(
        got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max()
    )
