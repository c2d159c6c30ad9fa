"""MAP training of the small MLPs used by the demo and the notebooks."""

from __future__ import annotations

import torch
from torch import nn

from .settings import DemoSettings

__all__ = ["train_mlp"]


def train_mlp(
    x: torch.Tensor, y: torch.Tensor, settings: DemoSettings, seed: int
) -> nn.Module:
    """Train a two-hidden-layer tanh MLP (MAP with weight decay from the prior).

    The training runs in float64 and the network is returned in ``x``'s dtype:
    trained in float32, the rounding of the CPU's kernels (AVX-512 against AVX2)
    led 1,000 full-batch Adam steps to different networks on different machines
    (``tests/examples/test_training.py``).

    Parameters
    ----------
    x : torch.Tensor
        ``(N, D)``.
    y : torch.Tensor
        ``(N, 1)`` (regression) or ``(N,)`` labels.
    settings : DemoSettings
        Sizes and hyperparameters.
    seed : int
        Initialisation seed.

    Returns
    -------
    torch.nn.Module
        The trained model in eval mode.

    """
    torch.manual_seed(seed)
    regression = settings.task == "regression"
    out = 1 if regression else 2
    h = settings.hidden
    model = nn.Sequential(
        nn.Linear(x.shape[1], h),
        nn.Tanh(),
        nn.Linear(h, h),
        nn.Tanh(),
        nn.Linear(h, out),
    )
    dtype = x.dtype
    model, x = model.double(), x.double()
    y = y.double() if y.is_floating_point() else y
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(settings.train_steps):
        optimizer.zero_grad()
        f = model(x)
        if regression:
            nll = 0.5 * ((f - y) ** 2).sum() / settings.sigma_noise**2
        else:
            nll = nn.functional.cross_entropy(f, y, reduction="sum")
        reg = (
            0.5
            * settings.prior_precision
            * sum(p.square().sum() for p in model.parameters())
        )
        ((nll + reg) / x.shape[0]).backward()
        optimizer.step()
    return model.to(dtype).eval()
