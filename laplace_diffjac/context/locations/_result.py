"""What the location optimiser returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["LocationHistory", "LocationResult"]


@dataclass
class LocationHistory:
    """What happened while optimising.

    Attributes
    ----------
    objective : list of float
        Minibatch estimate of the Nyström gap at every step (with
        ``objective="evidence"``: minus the evidence bound on all data).
    time : list of float
        Seconds since the start of the steps at every step.
    initial_objective, final_objective : float
        The gap on the whole data set before and after optimising; NaN unless
        ``evaluate_full=True`` (it costs two passes over all ``N`` inputs).
    stopped_early : bool
        Whether early stopping ended the run before ``steps``.

    """

    objective: list[float] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    initial_objective: float = math.nan
    final_objective: float = math.nan
    stopped_early: bool = False


@dataclass
class LocationResult:
    """Optimised locations ``(M, *input_shape)`` and the :class:`LocationHistory`.

    With ``objective="evidence"`` and ``learn_hyperparameters=True`` it also
    carries the fitted ``prior_precision`` and (regression) ``sigma_noise``;
    otherwise they are ``None``.
    """

    locations: torch.Tensor
    history: LocationHistory
    prior_precision: Optional[float] = None
    sigma_noise: Optional[float] = None
