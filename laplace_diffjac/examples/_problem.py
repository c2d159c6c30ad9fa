"""The demo's problem: data, the trained network, test inputs and metrics."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..context import LocationResult, optimize_locations
from .datasets import make_moons, make_regression_gap
from .settings import DemoSettings
from .training import train_mlp

__all__ = ["Problem", "latent_variance", "make_problem", "test_grid"]


@dataclass
class Problem:
    """Data, trained model and what every method is evaluated on."""

    settings: DemoSettings
    model: nn.Module
    loader: DataLoader
    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    grid: torch.Tensor
    prior_precision: float = 1.0

    @property
    def sigma_noise(self) -> float:
        return self.settings.sigma_noise

    def optimized_locations(
        self, m: int, init: torch.Tensor, seed: int, progress_bar: bool, **options: Any
    ) -> LocationResult:
        """``optimize_locations`` on this problem with the demo's optimiser settings.

        Parameters
        ----------
        m : int
            Number of locations.
        init : torch.Tensor
            Starting locations ``(m, D)``.
        seed : int
            Seed of the minibatch order.
        progress_bar : bool
            Show the optimiser's progress bar.
        **options
            Further keyword arguments of :func:`laplace_diffjac.optimize_locations`.

        Returns
        -------
        LocationResult

        """
        s = self.settings
        return optimize_locations(
            self.model,
            s.task,
            (self.x, self.y),
            m,
            init=init,
            steps=s.steps,
            lr=s.lr,
            patience=s.patience,
            seed=seed,
            progress_bar=progress_bar,
            sigma_noise=self.sigma_noise,
            **options,
        )

    def nll(self, prediction: Any) -> float:
        """Test NLL of a laplace-torch style prediction (probit for classes)."""
        task, s = self.settings.task, self.settings
        if task == "regression":
            mean, var = prediction
            var = var.detach().reshape(-1) + s.sigma_noise**2
            r = (self.y_test.reshape(-1) - mean.detach().reshape(-1)) ** 2
            return float((0.5 * (torch.log(2 * math.pi * var) + r / var)).mean())
        p = prediction.detach().clamp_min(1e-12)
        return float(-torch.log(p[torch.arange(len(self.y_test)), self.y_test]).mean())


def make_problem(settings: DemoSettings, seed: int) -> Problem:
    """Draw the data, train the MAP network and set up the test inputs."""
    gen = torch.Generator().manual_seed(seed)
    s = settings
    make: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    if s.task == "regression":
        make = lambda n: make_regression_gap(n, gen, s.data_noise)  # noqa: E731
    else:
        make = lambda n: make_moons(n, gen, s.data_noise, s.label_noise)  # noqa: E731
    x, y = make(s.n)
    x_test, y_test = make(max(200, s.n // 2))
    model = train_mlp(x, y, s, seed)
    loader = DataLoader(TensorDataset(x, y), batch_size=256)
    return Problem(s, model, loader, x, y, x_test, y_test, test_grid(x, s.task))


def test_grid(x: torch.Tensor, task: str) -> torch.Tensor:
    """Test inputs where the latent variances are compared."""
    if task == "regression":
        return torch.linspace(-5, 5, 200).unsqueeze(1)
    lo, hi = x.min(0).values, x.max(0).values
    g0, g1 = torch.linspace(lo[0], hi[0], 30), torch.linspace(lo[1], hi[1], 30)
    return torch.cartesian_prod(g0, g1)


def latent_variance(la: Any, x: torch.Tensor) -> torch.Tensor:
    """Diagonal of a posterior's latent covariance at ``x``, ``(B, C)``."""
    Js, _ = la.backend.jacobians(x)
    return la.functional_variance(Js).diagonal(dim1=-2, dim2=-1).detach()
