"""The location objective's fast kernels against plain references.

``cross_feature_gram`` (first side differentiated only) against the float64
reference Gram, gradcheck and autograd through ``feature_gram``;
``symmetric_product`` against ``A @ B.T``; ``explained_trace`` at a size
where its blocked symmetric product is used, against a dense solve (value and
gradients, also in the Hessians).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac.kernels import explained_trace, output_hessians
from laplace_diffjac.kernels._cross_gram import cross_feature_gram
from laplace_diffjac.kernels._products import symmetric_product
from laplace_diffjac.kernels._structured import structured_features
from laplace_diffjac.kernels._structured_features import feature_gram
from tests.references import reference_jacobians

F64 = torch.float64


def _mlp(frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 6), nn.Sigmoid(), nn.Linear(6, 3)
    ).double()
    if frozen:
        model[0].weight.requires_grad_(False)
        model[4].bias.requires_grad_(False)
    return model


def _x(b: int, seed: int) -> torch.Tensor:
    return torch.randn(b, 4, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("frozen", [False, True])
def test_cross_feature_gram_value_and_gradients(frozen: bool) -> None:
    model = _mlp(frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    x1, x2 = _x(4, 1).requires_grad_(), _x(6, 2)
    f2 = structured_features(model, x2).detach()
    K = cross_feature_gram(structured_features(model, x1), f2, 0.3)
    J1, _ = reference_jacobians(model, x1.detach(), params)
    J2, _ = reference_jacobians(model, x2, params)
    ref = 0.3 * torch.einsum("acp,bep->acbe", J1, J2).reshape(12, 18)
    torch.testing.assert_close(K, ref, rtol=1e-10, atol=1e-12)
    W = torch.randn(12, 18, generator=torch.Generator().manual_seed(3), dtype=F64)
    wrt = [x1, *params]
    grads = torch.autograd.grad((K * W).sum(), wrt, allow_unused=True)
    plain = feature_gram(structured_features(model, x1), f2, 0.3)
    plain_grads = torch.autograd.grad((plain * W).sum(), wrt, allow_unused=True)
    for a, b, t in zip(grads, plain_grads, wrt):
        zero = torch.zeros_like(t)
        a, b = zero if a is None else a, zero if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x: cross_feature_gram(structured_features(model, x), f2, 0.3), (x1,)
    )


def test_cross_feature_gram_second_side_with_graph_is_plain_autograd() -> None:
    model = _mlp()
    x1, x2 = _x(3, 1).requires_grad_(), _x(2, 2).requires_grad_()
    K = cross_feature_gram(
        structured_features(model, x1), structured_features(model, x2)
    )
    (g2,) = torch.autograd.grad(K.sum(), x2)
    ref = feature_gram(structured_features(model, x1), structured_features(model, x2))
    (g2_ref,) = torch.autograd.grad(ref.sum(), x2)
    torch.testing.assert_close(g2, g2_ref, rtol=1e-12, atol=1e-14)
    assert g2.abs().max() > 0


@pytest.mark.parametrize("n", [100, 800, 1300])
def test_symmetric_product_equals_the_full_product(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    A = torch.randn(n, 37, generator=gen, dtype=F64)
    d = torch.rand(37, generator=gen, dtype=F64) - 0.3
    out = symmetric_product(A, A * d)
    torch.testing.assert_close(out, (A * d) @ A.T, rtol=1e-12, atol=1e-12)
    assert out.is_contiguous()


def _dense_reference(K_zz, K_zx, lam, jitter):
    n = K_zz.shape[0]
    K = K_zz + jitter * K_zz.diagonal().mean() * torch.eye(n, dtype=F64)
    Q = K_zx.T @ torch.linalg.solve(K, K_zx)
    b, c = lam.shape[:2]
    return torch.einsum(
        "bce,bce->", lam, torch.einsum("acae->ace", Q.reshape(b, c, b, c))
    )


@pytest.mark.parametrize("kind", ["softmax", "gaussian", "indefinite"])
@pytest.mark.parametrize("n_z", [3, 90])  # 90 locations x 10 outputs: blocked product
def test_explained_trace_matches_a_dense_solve(kind: str, n_z: int) -> None:
    gen = torch.Generator().manual_seed(n_z)
    c, b = (3, 4) if n_z == 3 else (10, 12)
    F = torch.randn(n_z * c + b * c, n_z * c + 5, generator=gen, dtype=F64)
    K = F @ F.T
    K_zz, K_zx = K[: n_z * c, : n_z * c].clone(), K[: n_z * c, n_z * c :].clone()
    f = 3 * torch.randn(b, c, generator=gen, dtype=F64)
    if kind == "indefinite":
        A = torch.randn(b, c, c, generator=gen, dtype=F64)
        lam = A + A.transpose(1, 2)
    else:
        lam = output_hessians(
            f, "classification" if kind == "softmax" else "regression"
        )
    args = [t.clone().requires_grad_() for t in (K_zz, K_zx, lam)]
    value = explained_trace(*args, 1e-3)
    ref_args = [t.clone().requires_grad_() for t in (K_zz, K_zx, lam)]
    ref = _dense_reference(*ref_args, 1e-3)
    torch.testing.assert_close(value, ref, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(value, args)
    ref_grads = torch.autograd.grad(ref, ref_args)
    scale = max(float(g.abs().max()) for g in ref_grads)
    sym = 0.5 * (ref_grads[0] + ref_grads[0].T)
    torch.testing.assert_close(grads[0], sym, rtol=1e-8, atol=1e-10 * scale)
    torch.testing.assert_close(grads[1], ref_grads[1], rtol=1e-8, atol=1e-10 * scale)
    torch.testing.assert_close(grads[2], ref_grads[2], rtol=1e-8, atol=1e-10)
    # without a gradient in the Hessians: the same value
    no_grad_lam = explained_trace(K_zz, K_zx, lam, 1e-3)
    torch.testing.assert_close(no_grad_lam, ref.detach(), rtol=1e-10, atol=1e-10)
