"""Random versus optimised context locations on small synthetic problems.

A small MLP is trained on 1-D regression with a gap or on 2-D two moons with
overlapping classes and label noise; the
full-data GGN Laplace (laplace-torch ``FullLaplace`` on ``DiffBackPackGGN``) is the
reference. ``M`` context locations are chosen at random from the training inputs
or optimised from that random start with
:func:`laplace_diffjac.optimize_locations`, and used by two posteriors:

* ``FunctionalLaplace`` (laplace-torch's subset-of-data GP) fitted on the locations
  (:class:`laplace_diffjac.laplace_integration.LocationFunctionalLaplace`, with
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
from dataclasses import dataclass, field
from typing import Any

import torch
from laplace import Laplace

from ..backends import DiffBackPackGGN
from ..context import ContextPosterior, LocationHistory, random_subset
from ..laplace_integration import LocationFunctionalLaplace
from ._hyperparameters import choose_prior_precision
from ._problem import Problem, latent_variance, make_problem
from .settings import DemoSettings

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
    hyperparameters : dict of str to float
        The prior precision every method uses (``'prior_precision'``) and
        ``'sigma_noise'``; chosen by evidence, also ``'evidence_locations'``,
        ``'evidence'`` and ``'evidence_nll'`` (see
        :func:`~laplace_diffjac.examples._hyperparameters.choose_prior_precision`).
    prior_by_evidence : bool
        Whether the prior precision was chosen by the evidence.

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
    hyperparameters: dict[str, float] = field(default_factory=dict)
    prior_by_evidence: bool = False

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


def _full_laplace(problem: Problem) -> Any:
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
    return full


def _add_reference(problem: Problem, result: DemoResult) -> torch.Tensor:
    """Fit the full-data GGN Laplace; add its row; return its grid variances."""
    start = time.perf_counter()
    full = _full_laplace(problem)
    var_full = latent_variance(full, problem.grid)
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
    problem: Problem, result: DemoResult, seed: int, progress_bar: bool
) -> None:
    """Random subset and, starting from it, optimised locations."""
    s = problem.settings
    Z_random = random_subset(problem.x, s.m, torch.Generator().manual_seed(seed + 1))
    start = time.perf_counter()
    opt = problem.optimized_locations(
        s.m,
        Z_random,
        seed,
        progress_bar,
        evaluate_full=True,
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
    problem: Problem, method: str, hessian: str | None, Z: torch.Tensor
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
    problem: Problem, result: DemoResult, var_full: torch.Tensor
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
            var = latent_variance(la, problem.grid)
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
    prior_precision: str | float = "evidence",
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
    prior_precision : 'evidence' or float, default='evidence'
        ``'evidence'``: chosen by the evidence of a context posterior on
        ``settings.evidence_m`` optimised locations
        (``optimize_prior_precision(method="marglik")``);
        a number: that value (the MAP's weight decay is ``settings.prior_precision``).

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
        problem = make_problem(settings, seed)
        result = DemoResult(
            settings=settings,
            seed=seed,
            data={"x": problem.x, "y": problem.y, "grid": problem.grid},
        )
        _choose_locations(problem, result, seed, progress_bar)
        if prior_precision == "evidence":
            result.hyperparameters = choose_prior_precision(problem, seed)
            problem.prior_precision = result.hyperparameters["prior_precision"]
            result.prior_by_evidence = True
        else:
            problem.prior_precision = float(prior_precision)
            result.hyperparameters = {
                "prior_precision": problem.prior_precision,
                "sigma_noise": settings.sigma_noise,
            }
        var_full = _add_reference(problem, result)
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
    hp = result.hyperparameters
    lines.append("")
    if hp:
        how = "(fixed)"
        if result.prior_by_evidence:
            how = (
                f"(by the evidence of ContextPosterior on "
                f"{int(hp['evidence_locations'])} optimised locations: "
                f"{hp['evidence']:.2f}; its test NLL {hp['evidence_nll']:.3f})"
            )
        noise = ""
        if result.settings.task == "regression":  # no noise in a classification
            noise = f"; sigma_noise {hp['sigma_noise']:.4g}"
        lines.append(
            f"prior precision {hp['prior_precision']:.4g} {how}, used by every "
            f"row{noise}"
        )
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
