"""Test metrics: NLPD, accuracy, RMSE, ECE and the variance comparison.

All functions take plain tensors and return Python floats; the predictive of every
method is reduced to class probabilities ``(n, C)`` or a Gaussian mean and
variance ``(n, 1)`` before it gets here.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "COVERAGES",
    "accuracy",
    "accuracy_coverage",
    "aurc",
    "auroc",
    "ece",
    "entropy",
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


#: Coverages at which the accuracy–coverage curve is reported.
COVERAGES = tuple(round(0.05 * k, 2) for k in range(1, 21))


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Predictive entropy ``−Σ_c p_c log p_c`` per input (nats).

    Parameters
    ----------
    probs : torch.Tensor
        ``(n, C)``.

    Returns
    -------
    torch.Tensor
        ``(n,)`` float64.

    """
    p = probs.double()
    return -(p * torch.log(p.clamp_min(1e-300))).sum(dim=1)


def auroc(score: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve of ``score`` for telling positives from negatives.

    Rank-based (Mann–Whitney U with mid-ranks), so tied scores count one half:
    ``(Σ ranks of positives − n₊(n₊ + 1)/2) / (n₊ n₋)``. A constant score gives 0.5.

    Parameters
    ----------
    score : torch.Tensor
        ``(n,)``; higher means "more likely positive" (out-of-distribution).
    positive : torch.Tensor
        ``(n,)`` bool.

    Returns
    -------
    float

    Raises
    ------
    ValueError
        Without both positives and negatives.

    """
    s = score.double().reshape(-1)
    pos = positive.bool().reshape(-1)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("auroc needs both positives and negatives in `positive`.")
    ranks = _mid_ranks(s)
    u = float(ranks[pos].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def _mid_ranks(s: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n of ``s`` ascending, tied values sharing their mean rank."""
    values, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    upper = torch.cumsum(counts, 0).double()  # last rank of each distinct value
    mid = upper - (counts.double() - 1) / 2
    return mid[inverse]


def _expected_errors(uncertainty: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """Expected errors among the ``k`` most certain inputs, ``k = 1..n``.

    Inputs are taken in increasing ``uncertainty``; inside a group of tied values
    the order is uniformly random, so the expected count grows linearly across it.
    """
    u = uncertainty.double().reshape(-1)
    wrong = 1.0 - correct.double().reshape(-1)
    values, inverse, counts = torch.unique(u, return_inverse=True, return_counts=True)
    group_errors = torch.zeros(values.numel(), dtype=torch.float64)
    group_errors.index_add_(0, inverse, wrong)
    ends = torch.cumsum(counts, 0)
    before = torch.cumsum(group_errors, 0) - group_errors
    k = torch.arange(1, u.numel() + 1)
    g = torch.searchsorted(ends, k)  # group holding position k
    start = ends[g] - counts[g]
    return before[g] + (k - start).double() * group_errors[g] / counts[g].double()


def aurc(uncertainty: torch.Tensor, correct: torch.Tensor) -> float:
    """Area under the risk–coverage curve (lower is better).

    ``(1/n) Σ_k e_k / k``, ``e_k`` the (expected, for ties) errors among the ``k``
    inputs of lowest ``uncertainty`` (Geifman et al. 2019); a constant uncertainty
    gives the error rate.

    Parameters
    ----------
    uncertainty : torch.Tensor
        ``(n,)``; the least uncertain inputs are kept first.
    correct : torch.Tensor
        ``(n,)`` bool, the prediction is right.

    Returns
    -------
    float

    """
    errors = _expected_errors(uncertainty, correct)
    k = torch.arange(1, errors.numel() + 1, dtype=torch.float64)
    return float((errors / k).mean())


def accuracy_coverage(
    uncertainty: torch.Tensor,
    correct: torch.Tensor,
    coverages: tuple[float, ...] = COVERAGES,
) -> list[float]:
    """Accuracy on the ``ceil(c·n)`` least uncertain inputs, for each coverage ``c``.

    Parameters
    ----------
    uncertainty, correct : torch.Tensor
        As in :func:`aurc`.
    coverages : tuple of float
        In ``(0, 1]``.

    Returns
    -------
    list of float
        One accuracy per coverage (expected over tie orders).

    """
    errors = _expected_errors(uncertainty, correct)
    n = errors.numel()
    out = []
    for c in coverages:
        k = max(1, math.ceil(c * n - 1e-9))
        out.append(1.0 - float(errors[k - 1]) / k)
    return out
