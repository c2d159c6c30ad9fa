"""Small synthetic problems: 1-D regression with a gap and noisy two moons."""

from __future__ import annotations

import math

import torch

__all__ = ["make_moons", "make_regression_gap"]


def make_regression_gap(
    n: int, generator: torch.Generator, noise: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D regression ``y = sin(2x) + ε`` with inputs in ``[-3, -1] ∪ [1, 3]``.

    Parameters
    ----------
    n : int
        Number of points.
    generator : torch.Generator
        Random generator.
    noise : float, default=0.1
        Noise standard deviation.

    Returns
    -------
    x : torch.Tensor
        ``(n, 1)``.
    y : torch.Tensor
        ``(n, 1)``.

    """
    u = torch.rand(n, generator=generator) * 2
    side = torch.rand(n, generator=generator) < 0.5
    x = torch.where(side, u - 3, u + 1).unsqueeze(1)
    y = torch.sin(2 * x) + noise * torch.randn(n, 1, generator=generator)
    return x, y


def make_moons(
    n: int, generator: torch.Generator, noise: float = 0.1, label_noise: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaving half circles (as scikit-learn's ``make_moons``).

    Parameters
    ----------
    n : int
        Number of points (half per class).
    generator : torch.Generator
        Random generator.
    noise : float, default=0.1
        Standard deviation of the Gaussian noise added to the inputs.
    label_noise : float, default=0.0
        Probability of flipping each label (drawn only when positive, so the
        default reproduces earlier draws).

    Returns
    -------
    x : torch.Tensor
        ``(n, 2)``.
    y : torch.Tensor
        ``(n,)`` class labels in ``{0, 1}``.

    """
    n0 = n // 2
    n1 = n - n0
    t0 = torch.rand(n0, generator=generator) * math.pi
    t1 = torch.rand(n1, generator=generator) * math.pi
    outer = torch.stack([torch.cos(t0), torch.sin(t0)], 1)
    inner = torch.stack([1 - torch.cos(t1), 0.5 - torch.sin(t1)], 1)
    x = torch.cat([outer, inner]) + noise * torch.randn(n, 2, generator=generator)
    y = torch.cat([torch.zeros(n0), torch.ones(n1)]).long()
    if label_noise > 0:
        flip = torch.rand(n, generator=generator) < label_noise
        y = torch.where(flip, 1 - y, y)
    return x, y
