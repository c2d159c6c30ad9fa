"""Locations and hyperparameters on one objective: the context posterior's evidence.

``optimize_locations(..., objective="evidence")`` maximises the lower bound of
:meth:`ContextPosterior.log_marginal_likelihood` over ``Z`` and, with
``learn_hyperparameters=True``, over ``log δ`` (scalar prior precision) and, for
regression, ``log σ`` together. Its trace correction is the Nyström gap (the
default objective) scaled by ``1 / 2``, so the bound holds the gap as one term and
adds the log-determinant and data-fit terms that decide the hyperparameters. Every
step is exact, not a minibatch estimate: ``log det`` of a sum over data points has
no unbiased minibatch estimate, so each step reads all data twice, one batch at a
time (:func:`~laplace_diffjac.context.evidence_loss_backward`), which costs about
two ``ContextPosterior.fit`` passes a step. The gap stays the default because it
needs no targets and a step costs the same for any ``N``.
"""

from __future__ import annotations

import math
import time

import torch

from ..._progress import progress
from ...backends import JacobianBackend
from ...data import Data
from ...errors import InvalidInputError
from ...kernels import PriorPrecision
from ..posterior import evidence_loss_backward
from ._minibatches import EarlyStopping
from ._result import LocationHistory, LocationResult
from ._settings import LocationSettings

__all__ = ["OBJECTIVES", "check_objective", "optimise_evidence"]

#: What ``optimize_locations`` can minimise.
OBJECTIVES = ("gap", "evidence")


def check_objective(
    objective: str, learn_hyperparameters: bool, prior_precision: PriorPrecision
) -> None:
    """Refuse an unknown objective or a combination the evidence cannot take.

    Parameters
    ----------
    objective : str
        ``'gap'`` or ``'evidence'``.
    learn_hyperparameters : bool
        Whether the prior precision (and ``σ``) are learnt too.
    prior_precision : float or torch.Tensor
        The prior precision given.

    Raises
    ------
    InvalidInputError
        For an unknown objective, hyperparameters learnt with the gap, or a
        non-scalar prior precision with the evidence.

    """
    if objective not in OBJECTIVES:
        raise InvalidInputError(
            f"objective must be one of {OBJECTIVES}, got {objective!r}."
        )
    if learn_hyperparameters and objective != "evidence":
        raise InvalidInputError(
            "learn_hyperparameters=True needs objective='evidence' (the Nyström "
            "gap does not decide the prior precision)."
        )
    if objective == "evidence" and torch.as_tensor(prior_precision).numel() != 1:
        raise InvalidInputError(
            "objective='evidence' takes a scalar prior_precision; fit a "
            "ContextPosterior with prior_structure='layerwise' for layerwise priors."
        )


def optimise_evidence(
    backend: JacobianBackend,
    data: Data,
    likelihood: str,
    Z0: torch.Tensor,
    lr: float,
    hyperparameters: tuple[PriorPrecision, float | torch.Tensor, float],
    learn_hyperparameters: bool,
    s: LocationSettings,
) -> LocationResult:
    """Adam on ``−bound`` in ``Z`` (and ``log δ``, ``log σ``), exact every step.

    Parameters
    ----------
    backend : JacobianBackend
        Graph-connected backend.
    data : DataLoader or tuple
        Training data with targets.
    likelihood : {'regression', 'classification'}
        The likelihood.
    Z0 : torch.Tensor
        Initial locations ``(M, *input_shape)``.
    lr : float
        Adam learning rate of the locations (the hyperparameters' logarithms use
        ``0.1``).
    hyperparameters : tuple
        ``(prior_precision, sigma_noise, temperature)``; the first two are the
        starting values when learnt.
    learn_hyperparameters : bool
        Learn ``log δ`` and (regression) ``log σ`` with the locations.
    s : LocationSettings
        ``steps``, ``patience``, ``rel_tol``, ``jitter``, ``batch_size``,
        ``progress_bar``.

    Returns
    -------
    LocationResult
        Locations, history (``objective``: ``−bound`` per step), and the prior
        precision and (regression) ``σ`` after the last step.

    """
    prior_precision, sigma_noise, temperature = hyperparameters
    Z = Z0.detach().clone().requires_grad_(True)
    log_prec, log_sigma = torch.tensor(
        [math.log(float(prior_precision)), math.log(float(sigma_noise))],
        dtype=torch.float64,
        device=Z0.device,
    ).unbind()
    log_prec, log_sigma = log_prec.clone(), log_sigma.clone()
    hyper = [log_prec] + ([log_sigma] if likelihood == "regression" else [])
    hyper = [t.requires_grad_(learn_hyperparameters) for t in hyper]
    learnt = [t for t in hyper if t.requires_grad]
    groups = [{"params": [Z], "lr": lr}] + (
        [{"params": learnt, "lr": 0.1}] if learnt else []
    )
    optimizer = torch.optim.Adam(groups)
    history, stopper = LocationHistory(), EarlyStopping(s.patience, s.rel_tol)
    start = time.perf_counter()
    for _ in progress(range(s.steps), desc="Locations", enabled=s.progress_bar):
        optimizer.zero_grad()
        loss = evidence_loss_backward(
            backend, Z, data, likelihood, log_prec.exp(), log_sigma.exp(),
            temperature, s.jitter, s.batch_size, inputs=[Z, *learnt],
        )  # fmt: skip
        optimizer.step()
        history.objective.append(float(loss))
        history.time.append(time.perf_counter() - start)
        if stopper.stop(float(loss)):
            history.stopped_early = True
            break
    regression = likelihood == "regression"
    return LocationResult(
        Z.detach(),
        history,
        prior_precision=float(prior_precision)
        if not learn_hyperparameters
        else float(log_prec.detach().exp()),
        sigma_noise=None
        if not regression
        else (
            float(sigma_noise)
            if not learn_hyperparameters
            else float(log_sigma.detach().exp())
        ),
    )
