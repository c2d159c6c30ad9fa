"""``optimize_prior_precision`` for the context posterior, as laplace-torch's.

``method='marglik'`` runs Adam on the log prior precision (and, with
``learn_sigma_noise=True``, the log observation noise) against the evidence bound
of :mod:`._evidence`; ``method='gridsearch'`` evaluates a validation loss on a
log-spaced grid. Both keep laplace-torch's arguments and defaults (its
validation losses, mean squared error and mean NLL, without laplace-torch). One
departure: a running loss is reset before each grid value (laplace-torch 0.3
keeps accumulating it across the grid, so later values are scored on the sum of
all earlier predictions too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from ..._progress import progress
from ...data import reduce_mean


class TunablePosterior(Protocol):
    """What tuning reads and sets on a posterior (``ContextPosterior`` has it)."""

    likelihood: str
    prior_precision: Any
    sigma_noise: Any

    @property
    def n_layers(self) -> int: ...  # noqa: D102

    @property
    def n_params(self) -> int: ...  # noqa: D102

    @property
    def n_outputs(self) -> int: ...  # noqa: D102

    @property
    def fitted_prior_structure(self) -> str | None: ...  # noqa: D102

    def log_marginal_likelihood(  # noqa: D102
        self,
        prior_precision: torch.Tensor | None = None,
        sigma_noise: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def __call__(  # noqa: D102
        self,
        x: torch.Tensor,
        *,
        pred_type: str = ...,
        link_approx: str = ...,
        n_samples: int = ...,
    ) -> Any: ...


__all__ = ["TunablePosterior", "gridsearch", "marglik"]


def _initial(la: TunablePosterior, init: Any, prior_structure: str) -> torch.Tensor:
    prec = torch.as_tensor(init, dtype=torch.float64).reshape(-1)
    if prec.numel() == 1 and prior_structure != "scalar":
        if prior_structure not in ("layerwise", "diag"):
            raise ValueError(
                "prior_structure must be 'scalar', 'layerwise' or 'diag', got "
                f"{prior_structure!r}."
            )
        n = la.n_layers if prior_structure == "layerwise" else la.n_params
        prec = prec.expand(n).clone()
    if prec.numel() == la.n_params and prec.numel() != la.n_layers:
        raise ValueError(
            "method='marglik' cannot optimise a per-parameter ('diag') prior "
            "precision of a ContextPosterior (the evidence would need the P x P "
            "GGN); use prior_structure='scalar' or 'layerwise'."
        )
    if prec.numel() > 1 and la.fitted_prior_structure != "layerwise":
        raise ValueError(
            "A layerwise prior precision needs the posterior constructed with "
            "prior_structure='layerwise' (then fit)."
        )
    return prec


def marglik(
    la: TunablePosterior,
    init_prior_prec: float | torch.Tensor,
    prior_structure: str,
    n_steps: int,
    lr: float,
    learn_sigma_noise: bool,
    progress_bar: bool,
) -> None:
    """Maximise the evidence bound in log prior precision (and log σ) with Adam.

    Sets ``la.prior_precision`` (and ``la.sigma_noise``) to the result.

    Raises
    ------
    ValueError
        For a per-parameter structure, a layerwise one the fit cannot represent,
        or ``learn_sigma_noise`` with classification.

    """
    if learn_sigma_noise and la.likelihood != "regression":
        raise ValueError("learn_sigma_noise=True needs likelihood='regression'.")
    log_prec = _initial(la, init_prior_prec, prior_structure).log().requires_grad_()
    log_sigma = torch.as_tensor(la.sigma_noise, dtype=torch.float64).detach().log()
    params = [log_prec]
    if learn_sigma_noise:
        log_sigma.requires_grad_()
        params.append(log_sigma)
    optimizer = torch.optim.Adam(params, lr=lr)
    for _ in progress(range(n_steps), desc="marglik", enabled=progress_bar):
        optimizer.zero_grad()
        sigma = log_sigma.exp() if learn_sigma_noise else None
        neg = -la.log_marginal_likelihood(log_prec.exp(), sigma)
        neg.backward()
        optimizer.step()
    la.prior_precision = log_prec.detach().exp()
    la.sigma_noise = log_sigma.detach().exp()


def _validate(
    la: Any,
    val_loader: DataLoader,
    loss: Any,
    pred_type: str,
    link_approx: str,
    n_samples: int,
) -> float:
    """laplace-torch's ``validate`` (online metric or offline callable)."""
    offline = not hasattr(loss, "update")
    if not offline:
        loss.reset()
    means: list[torch.Tensor] = []
    variances: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    for X, y in val_loader:
        out = la(X, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples)
        if offline:
            means.append(out[0] if isinstance(out, tuple) else out)
            if isinstance(out, tuple):
                variances.append(out[1])
            targets.append(y)
        elif isinstance(out, tuple):
            try:
                loss.update(*out, y)
            except TypeError:  # an online loss taking (prediction, target) only
                loss.update(out[0], y)
        else:
            loss.update(out, y)
    if not offline:
        return float(loss.compute().sum())
    if variances:
        return float(loss(torch.cat(means), torch.cat(variances), torch.cat(targets)))
    return float(loss(torch.cat(means), torch.cat(targets)))


def gridsearch(
    la: TunablePosterior,
    val_loader: DataLoader | None,
    loss: Callable | Any | None,
    grid: torch.Tensor,
    pred_type: str,
    link_approx: str,
    n_samples: int,
    progress_bar: bool,
) -> torch.Tensor:
    """The grid value with the smallest validation loss (set on ``la`` too).

    Under ``torch.distributed`` the losses are averaged over the ranks (each
    rank may validate on its own shard), so every rank picks the same value.

    Returns
    -------
    torch.Tensor
        ``(1,)`` the chosen prior precision.

    Raises
    ------
    ValueError
        Without ``val_loader``.

    """
    if val_loader is None:
        raise ValueError(
            "gridsearch requires a validation set DataLoader (val_loader)."
        )
    if loss is None:
        loss = _default_loss(la)
    results = []
    for prec in progress(grid, desc="gridsearch", enabled=progress_bar):
        la.prior_precision = prec.reshape(1)
        try:
            results.append(
                _validate(la, val_loader, loss, pred_type, link_approx, n_samples)
            )
        except torch.linalg.LinAlgError:
            results.append(float("inf"))
    scores = reduce_mean(torch.tensor(results, dtype=torch.float64))
    best = grid[int(scores.argmin())].reshape(1)
    la.prior_precision = best
    return best


def _default_loss(la: TunablePosterior) -> Any:
    """laplace-torch's default validation losses, without laplace-torch."""
    if la.likelihood == "regression":
        return MeanSquaredError()
    return RunningNLL()


class MeanSquaredError:
    """Per-output mean squared error of the predictive mean (torchmetrics' value).

    ``update(mean, [var,] y)``; :meth:`compute` gives ``(C,)``, which the grid
    search sums, as laplace-torch does with ``torchmetrics.MeanSquaredError``.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every batch."""
        self._sum: torch.Tensor | float = 0.0
        self._count = 0

    def update(self, mean: torch.Tensor, *rest: torch.Tensor) -> None:
        """Add a batch: the predictive mean ``(b, C)`` and (last) the targets."""
        y = rest[-1]
        diff = mean.detach().reshape(len(y), -1) - y.reshape(len(y), -1).to(mean)
        self._sum = self._sum + diff.square().sum(0)
        self._count += len(y)

    def compute(self) -> torch.Tensor:
        """``(C,)`` mean squared error per output."""
        return torch.as_tensor(self._sum) / max(self._count, 1)


class RunningNLL:
    """Mean negative log-likelihood of the class probabilities at the targets.

    laplace-torch's ``RunningNLLMetric`` (``ignore_index=-100`` as there).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every batch."""
        self._sum = 0.0
        self._count = 0

    def update(self, probs: torch.Tensor, *rest: torch.Tensor) -> None:
        """Add a batch: probabilities ``(b, C)`` and (last) the class targets."""
        y = rest[-1].reshape(-1)
        keep = y != -100
        picked = probs.detach()[keep].gather(1, y[keep].long().unsqueeze(1))
        self._sum += float(-picked.log().sum())
        self._count += int(keep.sum())

    def compute(self) -> torch.Tensor:
        """``()`` mean negative log-likelihood."""
        return torch.tensor(self._sum / max(self._count, 1), dtype=torch.float64)
