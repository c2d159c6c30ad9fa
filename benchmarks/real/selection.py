"""Hyperparameter (prior precision ``δ``) selection, pluggable per method.

A method supplies ``build(δ) -> fitted posterior``. :func:`select_prior_precision`
uses the posterior's own evidence when it has one and the method allows it
(``optimize_prior_precision(method='marglik')``, as laplace-torch names it), and
otherwise the ``δ`` of a fixed log-grid with the lowest validation NLPD. The
returned label says which was used; it is recorded in every result row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .context import SeedContext
from .predictive import latent_variance, predictive_metrics

__all__ = ["Selection", "default_grid", "select_prior_precision", "validation_nlpd"]


@dataclass
class Selection:
    """The fitted posterior at the chosen ``δ`` and how ``δ`` was chosen."""

    posterior: Any
    delta: float
    how: str  # 'marglik', 'val-grid', ...


def default_grid(lo: float = -2.0, hi: float = 4.0, n: int = 13) -> list[float]:
    """``10^linspace(lo, hi, n)``, the same for every method and data set.

    Parameters
    ----------
    lo, hi : float
        Base-10 log bounds.
    n : int
        Number of grid points.

    Returns
    -------
    list of float

    """
    return [10**v for v in torch.linspace(lo, hi, n).tolist()]


def sigma_of(posterior: Any, ctx: SeedContext) -> float:
    """Observation noise the posterior predicts with (its own if it learns one)."""
    value = getattr(posterior, "sigma_noise", ctx.sigma_noise)
    return float(torch.as_tensor(value).detach().reshape(-1)[0])


def validation_nlpd(posterior: Any, ctx: SeedContext) -> float:
    """Validation NLPD of a fitted posterior (probit / Gaussian predictive).

    Parameters
    ----------
    posterior : object
        With ``functional_variance``.
    ctx : SeedContext
        Validation Jacobians and outputs.

    Returns
    -------
    float
        ``inf`` if the predictive is not finite.

    """
    var = latent_variance(posterior, ctx.jac_val)
    value = predictive_metrics(
        ctx.likelihood, ctx.f_val, var, ctx.split.y_val, sigma_of(posterior, ctx)
    )["nlpd"]
    return value if math.isfinite(value) else math.inf


def _delta_of(posterior: Any) -> float:
    return float(torch.as_tensor(posterior.prior_precision).detach().reshape(-1)[0])


def select_prior_precision(
    build: Callable[[float], Any],
    ctx: SeedContext,
    grid: list[float],
    use_evidence: bool = True,
    initial: float = 1.0,
    shared: bool = False,
) -> Selection:
    """Choose ``δ`` by the posterior's evidence, else by validation NLPD.

    Parameters
    ----------
    build : callable
        ``build(δ)`` returns a posterior fitted at prior precision ``δ``.
    ctx : SeedContext
        Validation data.
    grid : list of float
        The log-grid for validation selection.
    use_evidence : bool, default=True
        Try ``optimize_prior_precision(method='marglik')`` first, when the
        posterior has it (and it is not refused with ``NotImplementedError``).
    initial : float, default=1.0
        ``δ`` to build at before evidence maximisation.
    shared : bool, default=False
        ``build`` returns one object re-tuned in place (e.g. ELLA, whose
        ``prior_precision`` setter refreshes the posterior): rebuild at the chosen
        ``δ`` after the grid.

    Returns
    -------
    Selection

    """
    if use_evidence:
        posterior = build(initial)
        if hasattr(posterior, "optimize_prior_precision"):
            try:
                posterior.optimize_prior_precision(method="marglik")
            except NotImplementedError:
                pass
            else:
                return Selection(posterior, _delta_of(posterior), "marglik")
    best: Selection | None = None
    best_score = math.inf
    for delta in grid:
        posterior = build(delta)
        score = validation_nlpd(posterior, ctx)
        if best is None or score < best_score:
            best, best_score = Selection(posterior, delta, "val-grid"), score
    assert best is not None
    if shared:
        best.posterior = build(best.delta)
    return best
