"""Random versus optimised context locations on small synthetic problems.

A small MLP is trained on 1-D regression with a gap or on 2-D two moons with
overlapping classes and label noise; the
full-data GGN Laplace (laplace-torch ``FullLaplace`` on ``DiffBackPackGGN``) is the
reference. ``M`` context locations are chosen at random from the training inputs
or optimised from that random start with
:func:`laplace_diffjac.optimize_locations`, and used by two posteriors:

* ``FunctionalLaplace`` (laplace-torch's subset-of-data GP) fitted on the locations
  (:class:`laplace_diffjac.context.LocationFunctionalLaplace`, with
  ``reweight=True``: each location stands for ``N / M`` training points, and
  ``output_hessian='full'``: the GGN's whole ``C × C`` likelihood Hessian, not
  laplace-torch's diagonal; for classification the table also shows the diagonal
  one, ``FunctionalLaplace (diag Λ)``, whose error is dominated by that choice);
* :class:`laplace_diffjac.context.ContextPosterior` (DTC, all ``N``
  points seen through the locations).

Errors are ``mean |log var − log var_full|`` of the latent predictive variance on a
test grid, averaged over the grid and the ``C`` latent outputs (for classification
the per-class latent variances ``var_c``, the diagonal of the ``C × C`` latent
covariance). Regression: 200 points on ``[-5, 5]`` (gap and extrapolation
included). Classification: a 30 × 30 grid over the training inputs' bounding box,
where the data decide the posterior; far outside it every method returns nearly
the prior and the comparison would only be diluted. NLL is on held-out data from
the training distribution (probit link for classification).

The two-moons problem is deliberately not separable (input noise 0.15 and 10 %
flipped labels): with clean moons a MAP network is near-certain on the training
data, ``Λₙ ≈ 0``, the data barely move the posterior and every method matches it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..backends import DiffBackPackGGN
from ..context import (
    ContextPosterior,
    LocationFunctionalLaplace,
    LocationHistory,
    optimize_locations,
    random_subset,
)
from .datasets import make_moons, make_regression_gap
from .settings import DemoSettings
from .training import train_mlp

__all__ = ["DemoResult", "format_table", "run_demo"]


@dataclass
class DemoResult:
    """Everything a demo run produced.

    Attributes
    ----------
    settings : DemoSettings
        Sizes and hyperparameters of the run.
    seed : int
        The seed of data, training and locations.
    rows : list of dict
        One row per (method, locations): ``method``, ``locations``, ``error``,
        ``nll``, ``time``.
    objective : dict of str to float
        Nyström gap on the whole data at the ``'random'`` and ``'optimised'``
        locations.
    optimisation_time : float
        Seconds spent optimising the locations.
    data : dict of str to torch.Tensor
        ``x``, ``y`` (training data) and ``grid`` (test grid).
    curves : dict of str to torch.Tensor
        Latent variances on the grid, ``(G, C)``, per ``'method/locations'`` and
        ``'full'``.
    locations : dict of str to torch.Tensor
        ``'random'`` and ``'optimised'`` locations ``(M, D)``.
    history : LocationHistory or None
        The optimiser's history.

    """

    settings: DemoSettings
    seed: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    objective: dict[str, float] = field(default_factory=dict)
    optimisation_time: float = math.nan
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    curves: dict[str, torch.Tensor] = field(default_factory=dict)
    locations: dict[str, torch.Tensor] = field(default_factory=dict)
    history: LocationHistory | None = None

    def row(self, method: str, locations: str) -> dict[str, Any]:
        """Return the row of a method and its locations.

        Parameters
        ----------
        method : str
            E.g. ``'FunctionalLaplace'`` or ``'ContextPosterior'``.
        locations : str
            E.g. ``'random 16'``.

        Returns
        -------
        dict
            The row.

        Raises
        ------
        KeyError
            If there is no such row.

        """
        for r in self.rows:
            if r["method"] == method and r["locations"] == locations:
                return r
        raise KeyError((method, locations))


@dataclass
class _Problem:
    """Data, trained model and what every method is evaluated on."""

    settings: DemoSettings
    model: nn.Module
    loader: DataLoader
    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    grid: torch.Tensor

    @property
    def sigma_noise(self) -> float:
        return self.settings.sigma_noise

    @property
    def prior_precision(self) -> float:
        return self.settings.prior_precision

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


def _make_problem(settings: DemoSettings, seed: int) -> _Problem:
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
    return _Problem(s, model, loader, x, y, x_test, y_test, _test_grid(x, s.task))


def _test_grid(x: torch.Tensor, task: str) -> torch.Tensor:
    if task == "regression":
        return torch.linspace(-5, 5, 200).unsqueeze(1)
    lo, hi = x.min(0).values, x.max(0).values
    g0, g1 = torch.linspace(lo[0], hi[0], 30), torch.linspace(lo[1], hi[1], 30)
    return torch.cartesian_prod(g0, g1)


def _latent_variance(la: Any, x: torch.Tensor) -> torch.Tensor:
    Js, _ = la.backend.jacobians(x)
    return la.functional_variance(Js).diagonal(dim1=-2, dim2=-1).detach()


def _add_reference(problem: _Problem, result: DemoResult) -> torch.Tensor:
    """Fit the full-data GGN Laplace; add its row; return its grid variances."""
    start = time.perf_counter()
    full = Laplace(
        problem.model,
        problem.settings.task,
        subset_of_weights="all",
        hessian_structure="full",
        backend=DiffBackPackGGN,
        sigma_noise=problem.sigma_noise,
        prior_precision=problem.prior_precision,
    )
    full.fit(problem.loader)
    var_full = _latent_variance(full, problem.grid)
    pred = full(problem.x_test, pred_type="glm", link_approx="probit")
    result.rows.append(
        {
            "method": "Full GGN Laplace",
            "locations": f"all {problem.settings.n}",
            "error": 0.0,
            "nll": problem.nll(pred),
            "time": time.perf_counter() - start,
        }
    )
    result.curves["full"] = var_full
    return var_full


def _choose_locations(
    problem: _Problem, result: DemoResult, seed: int, progress_bar: bool
) -> None:
    """Random subset and, starting from it, optimised locations."""
    s = problem.settings
    Z_random = random_subset(problem.x, s.m, torch.Generator().manual_seed(seed + 1))
    start = time.perf_counter()
    opt = optimize_locations(
        problem.model,
        s.task,
        (problem.x, problem.y),
        s.m,
        init=Z_random,
        steps=s.steps,
        lr=s.lr,
        patience=s.patience,
        seed=seed,
        progress_bar=progress_bar,
        sigma_noise=problem.sigma_noise,
        prior_precision=problem.prior_precision,
    )
    result.optimisation_time = time.perf_counter() - start
    result.history = opt.history
    result.objective = {
        "random": opt.history.initial_objective,
        "optimised": opt.history.final_objective,
    }
    result.locations = {"random": Z_random, "optimised": opt.locations}


def _fit_on_locations(
    problem: _Problem, method: str, hessian: str | None, Z: torch.Tensor
) -> tuple[Any, Any]:
    """Fit one context method on ``Z``; return it and its test prediction."""
    task, sigma, prior = (
        problem.settings.task,
        problem.sigma_noise,
        problem.prior_precision,
    )
    if hessian is None:
        cp = ContextPosterior(
            problem.model, task, Z, sigma_noise=sigma, prior_precision=prior
        )
        cp.fit(problem.loader)
        return cp, cp(problem.x_test, link_approx="probit")
    la = LocationFunctionalLaplace(
        problem.model,
        task,
        Z,
        reweight=True,
        output_hessian=hessian,
        prior_precision=prior,
        sigma_noise=sigma,
    )
    la.fit(problem.loader)
    return la, la(problem.x_test, pred_type="gp", link_approx="probit")


def _compare_methods(
    problem: _Problem, result: DemoResult, var_full: torch.Tensor
) -> None:
    methods: dict[str, str | None] = {
        "FunctionalLaplace": "full",
        "ContextPosterior": None,
    }
    if problem.settings.task == "classification":
        methods["FunctionalLaplace (diag Λ)"] = "diagonal"
    for name, Z in result.locations.items():
        for method, hessian in methods.items():
            start = time.perf_counter()
            la, pred = _fit_on_locations(problem, method, hessian, Z)
            var = _latent_variance(la, problem.grid)
            result.rows.append(
                {
                    "method": method,
                    "locations": f"{name} {problem.settings.m}",
                    "error": float((var.log() - var_full.log()).abs().mean()),
                    "nll": problem.nll(pred),
                    "time": time.perf_counter() - start,
                }
            )
            result.curves[f"{method}/{name}"] = var


def run_demo(
    task: str = "regression",
    m: int | None = None,
    steps: int | None = None,
    seed: int = 0,
    quick: bool = False,
    progress_bar: bool = True,
    num_threads: int | None = 1,
) -> DemoResult:
    """Train, fit the reference, choose locations both ways, compare.

    Parameters
    ----------
    task : {'regression', 'classification'}, default='regression'
        1-D regression with a gap, or 2-D two moons.
    m : int, optional
        Number of context locations (default 4 % of the data).
    steps : int, optional
        Location optimisation steps.
    seed : int, default=0
        Seeds data, training and locations.
    quick : bool, default=False
        Smoke-test sizes.
    progress_bar : bool, default=True
        Show the optimiser's progress bar.
    num_threads : int, optional
        torch's intra-op threads during the run, restored afterwards; ``None``
        leaves them alone. The problems are tiny: one thread is fastest, and on a
        loaded 2-core machine two threads contend (measured 5 s versus 110 s for
        the classification run).

    Returns
    -------
    DemoResult
        Table rows, objective values, curves for plotting.

    """
    settings = DemoSettings.for_task(task, m, steps, quick)
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        problem = _make_problem(settings, seed)
        result = DemoResult(
            settings=settings,
            seed=seed,
            data={"x": problem.x, "y": problem.y, "grid": problem.grid},
        )
        var_full = _add_reference(problem, result)
        _choose_locations(problem, result, seed, progress_bar)
        _compare_methods(problem, result, var_full)
        return result
    finally:
        torch.set_num_threads(previous)


def format_table(result: DemoResult) -> str:
    """Return the comparison as a plain-text table.

    Parameters
    ----------
    result : DemoResult
        A finished run.

    Returns
    -------
    str
        The table, with the objective and optimisation time below it.

    """
    head = (
        f"{'method':<26} {'locations':<14} {'log-var error':>13} "
        f"{'test NLL':>9} {'time [s]':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in result.rows:
        lines.append(
            f"{r['method']:<26} {r['locations']:<14} {r['error']:>13.3f} "
            f"{r['nll']:>9.3f} {r['time']:>9.2f}"
        )
    h = result.history
    lines.append("")
    lines.append(
        f"Nyström gap objective: random {result.objective['random']:.4g} -> "
        f"optimised {result.objective['optimised']:.4g} "
        f"({len(h.objective) if h else 0} steps, {result.optimisation_time:.1f} s)"
    )
    lines.append(
        "log-var error: mean |log var - log var(full GGN Laplace)| of the latent "
        "predictive on a test grid."
    )
    return "\n".join(lines)
