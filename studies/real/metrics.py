"""Test metrics: NLPD, accuracy, RMSE, ECE and the variance comparison.

All functions take plain tensors and return Python floats; the predictive of every
method is reduced to class probabilities ``(n, C)`` or a Gaussian mean and
variance ``(n, 1)`` before it gets here.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "accuracy",
    "ece",
    "gaussian_nlpd",
    "log_var_error",
    "nlpd",
    "rmse",
    "share_below",
]


def nlpd(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean negative log predictive probability of the true classes.

    Parameters
    ----------
    probs : torch.Tensor
        Predictive class probabilities ``(n, C)``.
    y : torch.Tensor
        Labels ``(n,)``.

    Returns
    -------
    float

    """
    p = probs.double().gather(1, y.long().view(-1, 1)).squeeze(1)
    return float(-torch.log(p.clamp_min(1e-300)).mean())


def gaussian_nlpd(mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> float:
    """Mean negative log density of ``y`` under ``N(mean, var)``.

    Parameters
    ----------
    mean, var, y : torch.Tensor
        ``(n, 1)`` (or ``(n,)``); ``var`` includes the observation noise.

    Returns
    -------
    float

    """
    mean, var, y = (t.double().reshape(-1) for t in (mean, var, y))
    return float(
        (0.5 * torch.log(2 * math.pi * var) + 0.5 * (y - mean) ** 2 / var).mean()
    )


def accuracy(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Share of inputs whose most probable class is the label.

    Parameters
    ----------
    probs : torch.Tensor
        ``(n, C)``.
    y : torch.Tensor
        ``(n,)``.

    Returns
    -------
    float

    """
    return float((probs.argmax(dim=1) == y.long()).double().mean())


def rmse(mean: torch.Tensor, y: torch.Tensor) -> float:
    """Root mean squared error of the predictive mean.

    Parameters
    ----------
    mean, y : torch.Tensor
        ``(n, 1)`` or ``(n,)``.

    Returns
    -------
    float

    """
    diff = mean.double().reshape(-1) - y.double().reshape(-1)
    return float(torch.sqrt((diff**2).mean()))


def ece(probs: torch.Tensor, y: torch.Tensor, n_bins: int = 10) -> float:
    """Top-label expected calibration error with equal-width confidence bins.

    ``Σ_b (n_b / n) |acc_b − conf_b|`` over bins ``((b−1)/B, b/B]`` of the top-label
    confidence (the first bin also holds confidence 0).

    Parameters
    ----------
    probs : torch.Tensor
        ``(n, C)``.
    y : torch.Tensor
        ``(n,)``.
    n_bins : int, default=10
        Number of bins ``B``.

    Returns
    -------
    float

    """
    conf, pred = probs.double().max(dim=1)
    correct = (pred == y.long()).double()
    bins = torch.clamp(torch.ceil(conf * n_bins).long() - 1, 0, n_bins - 1)
    total = 0.0
    for b in range(n_bins):
        mask = bins == b
        if mask.any():
            gap = correct[mask].mean() - conf[mask].mean()
            total += float(mask.double().mean() * gap.abs())
    return total


def log_var_error(var: torch.Tensor, var_full: torch.Tensor) -> float:
    """Mean ``|log var − log var_full|`` over all test inputs and outputs.

    Parameters
    ----------
    var, var_full : torch.Tensor
        Latent (diagonal) variances ``(n, C)`` of a method and of the full-data
        GGN Laplace at the same hyperparameters.

    Returns
    -------
    float

    """
    tiny = torch.finfo(torch.float64).tiny
    a = var.double().clamp_min(tiny).log()
    b = var_full.double().clamp_min(tiny).log()
    return float((a - b).abs().mean())


def share_below(var: torch.Tensor, var_full: torch.Tensor) -> float:
    """Share of latent variances strictly below the full posterior's.

    Parameters
    ----------
    var, var_full : torch.Tensor
        ``(n, C)``.

    Returns
    -------
    float

    """
    return float((var.double() < var_full.double()).double().mean())
