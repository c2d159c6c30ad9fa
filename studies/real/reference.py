"""The full-data GGN Laplace, at any prior precision from one eigendecomposition.

laplace-torch's ``FullLaplace`` (``hessian_structure='full'``, backend
``DiffBackPackGGN``) is fitted once per seed. Its posterior precision is
``h·H + δ I`` with ``H = Σₙ Jₙᵀ Λₙ Jₙ`` (``la.H``) and ``h = 1 / (σ² T)``. With
``H = V diag(g) Vᵀ`` (float64, once), for every ``δ``:

* the latent variance of test output ``c`` is ``Σₖ (Jc V)ₖ² / (h gₖ + δ)``;
* laplace-torch's log evidence ``log p(y|θ) − ½ (log det(hH + δI) − P log δ
  + δ ‖θ‖²)`` is a sum over ``gₖ``, so its maximiser over ``log δ`` is found on a
  fine grid refined by golden-section search, without a ``P × P`` factorisation
  per step (laplace-torch's ``optimize_prior_precision('marglik')`` takes one
  ``slogdet`` per Adam step, minutes per seed at ``P = 6310``).

Both are checked against ``FullLaplace`` itself in ``tests/test_real_study.py``.
"""

from __future__ import annotations

import math
import time

import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader

from laplace_diffjac import DiffBackPackGGN

__all__ = ["FullReference"]


class FullReference:
    """Full-data GGN Laplace of a trained network, for any ``δ``.

    Parameters
    ----------
    model : torch.nn.Module
        Trained network (MAP).
    likelihood : {'regression', 'classification'}
        The likelihood.
    train_loader : DataLoader
        Training data.
    sigma_noise : float, default=1.0
        Observation noise (regression).

    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        train_loader: DataLoader,
        sigma_noise: float = 1.0,
    ) -> None:
        self.model = model
        self.likelihood = likelihood
        self.la = Laplace(
            model,
            likelihood,
            subset_of_weights="all",
            hessian_structure="full",
            backend=DiffBackPackGGN,
            sigma_noise=sigma_noise,
        )
        start = time.perf_counter()
        self.la.fit(train_loader)
        self.fit_s = time.perf_counter() - start
        H = self.la.H.detach().to(torch.float64)
        start = time.perf_counter()
        self.eigenvalues, self.eigenvectors = torch.linalg.eigh(0.5 * (H + H.T))
        self.eigh_s = time.perf_counter() - start
        self.eigenvalues = self.eigenvalues.clamp_min(0)
        self.h = self._factor(sigma_noise)
        self.log_likelihood = float(self.la.log_likelihood)
        self.theta_sq = float((self.la.mean.detach().double() ** 2).sum())
        self.n_params = H.shape[0]

    def log_evidence(self, delta: float) -> float:
        """laplace-torch's ``log_marginal_likelihood`` at scalar prior precision.

        Parameters
        ----------
        delta : float
            Prior precision ``δ > 0``.

        Returns
        -------
        float

        """
        log_det = torch.log(self.h * self.eigenvalues + delta).sum()
        ratio = float(log_det) - self.n_params * math.log(delta)
        return self.log_likelihood - 0.5 * (ratio + delta * self.theta_sq)

    def best_delta(self, lo: float = -4.0, hi: float = 6.0) -> float:
        """The ``δ`` maximising :meth:`log_evidence` on ``[10^lo, 10^hi]``.

        Parameters
        ----------
        lo, hi : float
            Base-10 log bounds.

        Returns
        -------
        float

        """
        grid = torch.linspace(lo, hi, 201).tolist()
        values = [self.log_evidence(10**g) for g in grid]
        i = max(range(len(grid)), key=values.__getitem__)
        a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        phi = (math.sqrt(5) - 1) / 2
        for _ in range(40):  # golden-section on a unimodal bracket
            c, d = b - phi * (b - a), a + phi * (b - a)
            if self.log_evidence(10**c) > self.log_evidence(10**d):
                b = d
            else:
                a = c
        return 10 ** (0.5 * (a + b))

    def latent_variance(
        self, projected: torch.Tensor, delta: float, sigma_noise: float | None = None
    ) -> torch.Tensor:
        """Diagonal latent variances ``(n, C)`` at prior precision ``δ``.

        Parameters
        ----------
        projected : torch.Tensor
            ``J(x) V`` in float64, ``(n, C, P)`` (``V``: :attr:`eigenvectors`).
        delta : float
            Prior precision.
        sigma_noise : float, optional
            Observation noise (regression); default: the one at fit.

        Returns
        -------
        torch.Tensor
            float64.

        """
        h = self.h if sigma_noise is None else self._factor(sigma_noise)
        return (projected**2 / (h * self.eigenvalues + delta)).sum(-1)

    def _factor(self, sigma_noise: float) -> float:
        return 1.0 / (float(sigma_noise) ** 2 if self.likelihood == "regression" else 1)
