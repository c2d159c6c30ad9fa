"""One predictive for every method: MAP mean plus the method's latent variance.

Classification uses laplace-torch's default probit link,
``softmax(f / sqrt(1 + π/8 · diag Σ))``, for every method, so that methods differ
only in their latent variances; regression predicts ``N(f, diag Σ + σ²)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .metrics import accuracy, ece, gaussian_nlpd, nlpd, rmse

__all__ = ["latent_variance", "predictive_metrics", "probit"]


def latent_variance(obj: Any, jacobians: torch.Tensor) -> torch.Tensor:
    """Diagonal latent variances ``(n, C)`` of a fitted posterior.

    Parameters
    ----------
    obj : object
        Anything with ``functional_variance(Js) -> (n, C, C)`` (laplace-torch's
        Laplace classes, ELLA, VaLLA, ``ContextPosterior``).
    jacobians : torch.Tensor
        ``(n, C, P)``.

    Returns
    -------
    torch.Tensor
        float64.

    """
    with torch.no_grad():
        var = obj.functional_variance(jacobians)
    if var.dim() == 3:
        var = var.diagonal(dim1=1, dim2=2)
    return var.detach().to(torch.float64)


def probit(f: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Probit-approximated class probabilities ``(n, C)``.

    Parameters
    ----------
    f : torch.Tensor
        MAP logits ``(n, C)``.
    var : torch.Tensor
        Latent variances ``(n, C)``.

    Returns
    -------
    torch.Tensor
        float64.

    """
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * var.double().clamp_min(0))
    return torch.softmax(kappa * f.double(), dim=-1)


def predictive_metrics(
    task: str, f: torch.Tensor, var: torch.Tensor, y: torch.Tensor, sigma: float
) -> dict[str, float]:
    """Test metrics of the predictive built from ``(f, var)``.

    Parameters
    ----------
    task : {'classification', 'regression'}
        The task.
    f : torch.Tensor
        MAP outputs ``(n, C)``.
    var : torch.Tensor
        Latent variances ``(n, C)`` (zeros for MAP).
    y : torch.Tensor
        Targets.
    sigma : float
        Observation noise (regression).

    Returns
    -------
    dict
        ``nlpd`` and ``accuracy``/``ece`` or ``rmse``.

    """
    if task == "classification":
        probs = probit(f, var)
        return {
            "nlpd": nlpd(probs, y),
            "accuracy": accuracy(probs, y),
            "ece": ece(probs, y),
        }
    return {
        "nlpd": gaussian_nlpd(f, var + sigma**2, y),
        "rmse": rmse(f, y),
    }
