"""Problems shared by the context tests (models, data, the dense evidence bound)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import CASES
from tests.references import reference_jacobians

MLP = CASES[1]  # mlp-C3, P = 77, 6 parameter tensors


def evidence_data(likelihood: str, n: int = 8, seed: int = 1):
    model = MLP.model()
    x = MLP.inputs(n, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        f = model(x)
    if likelihood == "regression":
        y = f + 0.3 * torch.randn(f.shape, generator=gen, dtype=f.dtype)
    else:
        y = torch.randint(0, 3, (n,), generator=gen)
    return model, x, y, DataLoader(TensorDataset(x, y), batch_size=3)


def dense_bound(model, x, y, z, likelihood, prec, sigma):
    """The bound written out with dense (N C)² matrices from torch.func Jacobians."""
    Jx, fx = reference_jacobians(model, x)
    Jz, _ = reference_jacobians(model, z)
    fx = fx.detach()
    N, C, P = Jx.shape
    if likelihood == "regression":
        lam = torch.eye(C).double().expand(N, C, C) / sigma**2
        loglik = -0.5 * ((y - fx) ** 2).sum() / sigma**2
        sig = torch.as_tensor(sigma, dtype=torch.float64)
        loglik = loglik - N * C * torch.log(sig * math.sqrt(2 * math.pi))
    else:
        p = fx.softmax(-1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        loglik = -torch.nn.functional.cross_entropy(fx, y, reduction="sum")
    Kxx = Jx.reshape(N * C, P) @ Jx.reshape(N * C, P).T / prec
    Kzx = Jz.reshape(-1, P) @ Jx.reshape(N * C, P).T / prec
    Kzz = Jz.reshape(-1, P) @ Jz.reshape(-1, P).T / prec
    Q = Kzx.T @ torch.linalg.solve(Kzz, Kzx)
    eye = torch.eye(N * C).double()
    if likelihood == "regression":  # eigh has no gradient at repeated eigenvalues
        R = eye / sigma
    else:
        e, U = torch.linalg.eigh(torch.block_diag(*lam))
        R = U @ torch.diag(e.clamp_min(0).sqrt()) @ U.T
    logdet = torch.logdet(eye + R @ Q @ R)
    trace = torch.trace(torch.block_diag(*lam) @ (Kxx - Q))
    theta = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    scatter = prec * theta @ theta
    exact = torch.logdet(eye + R @ Kxx @ R)
    return loglik - 0.5 * (scatter + logdet + trace), loglik - 0.5 * (scatter + exact)


def ill_conditioned_problem():
    """Sixty locations on a 1-D line: far past the NTK's numerical rank."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 1)
    ).double()
    x = torch.linspace(-3, 3, 200, dtype=torch.float64).unsqueeze(1)
    y = torch.sin(2 * x)
    Z = torch.linspace(-3, 3, 60, dtype=torch.float64).unsqueeze(1)
    return model, x, y, Z


def _lam(f, likelihood, sigma):
    if likelihood == "regression":
        return torch.eye(f.shape[1]).double().expand(len(f), -1, -1) / sigma**2
    p = f.softmax(-1)
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


def _blocks(Ja, Jb, prec):
    return (
        torch.einsum("acp,bep->acbe", Ja, Jb).reshape(Ja.shape[0] * Ja.shape[1], -1)
        / prec
    )


def _per_input(cov, B, C):
    return torch.einsum("acae->ace", cov.reshape(B, C, B, C))


def _dense_gp(
    model, z, xs, likelihood, prec, sigma, scale, weight, full, joint, loop=False
):
    """Float64 GP posterior on locations ``z``: ``K** − K*M R (I + R K R)⁻¹ R K_M*``.

    ``K = scale J Jᵀ / prec``; ``R = (weight Λ / σ²)^{1/2}`` block-diagonal, with
    ``Λ`` the whole ``C × C`` block (``full``) or its diagonal. ``loop``: Jacobians
    from the plain autograd loop (``create_graph=True``), for gradients in ``xs``.
    """
    Jz, fz = reference_jacobians(model, z, loop=loop)
    Js, _ = reference_jacobians(model, xs, loop=loop)
    lam = _lam(fz.detach(), likelihood, 1.0) * weight / sigma**2
    if not full:
        lam = torch.diag_embed(lam.diagonal(dim1=1, dim2=2))
    s, U = torch.linalg.eigh(lam)
    R = torch.block_diag(*(U * s.clamp_min(0).sqrt()[:, None, :]) @ U.mT)
    Kzz, Kzs = scale * _blocks(Jz, Jz, prec), scale * _blocks(Jz, Js, prec)
    Kss = scale * _blocks(Js, Js, prec)
    eye = torch.eye(len(R)).double()
    cov = Kss - Kzs.T @ R @ torch.linalg.solve(eye + R @ Kzz @ R, R @ Kzs)
    return cov if joint else _per_input(cov, xs.shape[0], Js.shape[1])


def small_cnn() -> nn.Module:
    """A float64 two-convolution network on 1×8×8 images, 3 outputs (seed 0)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 4, 3, stride=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(36, 3),
    ).to(torch.float64)


def small_mlp() -> nn.Module:
    """A float64 4-16-16-3 tanh network (seed 0)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    ).to(torch.float64)
