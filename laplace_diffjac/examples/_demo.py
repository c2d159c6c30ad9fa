"""Random versus optimised context locations on small synthetic problems.

A small MLP is trained on 1-D regression with a gap or on 2-D two moons with
overlapping classes and label noise; the
full-data GGN Laplace (laplace-torch ``FullLaplace`` on ``DiffBackPackGGN``) is the
reference. ``M`` context locations are chosen at random from the training inputs
or optimised from that random start with :func:`laplace_diffjac.context.
optimize_locations`, and used by two posteriors:

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
from dataclasses import dataclass, field
from typing import Any

import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..backends import DiffBackPackGGN
from ..context._functional_laplace import LocationFunctionalLaplace
from ..context._init import random_subset
from ..context._optimizer import LocationResult, optimize_locations
from ..context._posterior import ContextPosterior

__all__ = [
    "DemoResult",
    "DemoSettings",
    "format_table",
    "make_moons",
    "make_regression_gap",
    "plot",
    "run_demo",
    "train_mlp",
]


@dataclass(frozen=True)
class DemoSettings:
    """Sizes and hyperparameters of one demo run (see :meth:`for_task`).

    ``data_noise`` is the target noise of the regression data and the input noise
    of two moons; ``label_noise`` the fraction of flipped two-moons labels;
    ``patience`` the early-stopping patience of the location optimiser.
    """

    task: str
    n: int
    m: int
    steps: int
    train_steps: int
    hidden: int
    sigma_noise: float
    prior_precision: float
    lr: float
    data_noise: float = 0.1
    label_noise: float = 0.0
    patience: int = 100

    @classmethod
    def for_task(
        cls, task: str, m: int | None, steps: int | None, quick: bool
    ) -> DemoSettings:
        """Return the default settings of a task, optionally overridden.

        Parameters
        ----------
        task : {'regression', 'classification'}
            The problem.
        m : int, optional
            Number of locations; default 4 % of ``n``.
        steps : int, optional
            Optimisation steps.
        quick : bool
            Smaller problem and fewer steps (smoke test).

        Returns
        -------
        DemoSettings
            The settings.

        """
        if task not in ("regression", "classification"):
            raise ValueError(f"Unknown task {task!r}.")
        n = 200 if quick else 400
        regression = task == "regression"
        return cls(
            task=task,
            n=n,
            m=m if m is not None else max(2, (4 * n) // 100),
            steps=steps if steps is not None else (30 if quick else 200),
            train_steps=300 if quick else 1000,
            hidden=50,
            sigma_noise=0.1 if regression else 1.0,
            prior_precision=1.0,
            lr=0.1,
            data_noise=0.1 if regression else 0.15,
            label_noise=0.0 if regression else 0.1,
            patience=30,
        )


def make_regression_gap(
    n: int, generator: torch.Generator, noise: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D regression ``y = sin(2x) + ε`` with inputs in ``[-3, -1] ∪ [1, 3]``.

    Parameters
    ----------
    n : int
        Number of points.
    generator : torch.Generator
        Random generator.
    noise : float, default=0.1
        Noise standard deviation.

    Returns
    -------
    x : torch.Tensor
        ``(n, 1)``.
    y : torch.Tensor
        ``(n, 1)``.

    """
    u = torch.rand(n, generator=generator) * 2
    side = torch.rand(n, generator=generator) < 0.5
    x = torch.where(side, u - 3, u + 1).unsqueeze(1)
    y = torch.sin(2 * x) + noise * torch.randn(n, 1, generator=generator)
    return x, y


def make_moons(
    n: int, generator: torch.Generator, noise: float = 0.1, label_noise: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaving half circles (as scikit-learn's ``make_moons``).

    Parameters
    ----------
    n : int
        Number of points (half per class).
    generator : torch.Generator
        Random generator.
    noise : float, default=0.1
        Standard deviation of the Gaussian noise added to the inputs.
    label_noise : float, default=0.0
        Probability of flipping each label (drawn only when positive, so the
        default reproduces earlier draws).

    Returns
    -------
    x : torch.Tensor
        ``(n, 2)``.
    y : torch.Tensor
        ``(n,)`` class labels in ``{0, 1}``.

    """
    n0 = n // 2
    n1 = n - n0
    t0 = torch.rand(n0, generator=generator) * math.pi
    t1 = torch.rand(n1, generator=generator) * math.pi
    outer = torch.stack([torch.cos(t0), torch.sin(t0)], 1)
    inner = torch.stack([1 - torch.cos(t1), 0.5 - torch.sin(t1)], 1)
    x = torch.cat([outer, inner]) + noise * torch.randn(n, 2, generator=generator)
    y = torch.cat([torch.zeros(n0), torch.ones(n1)]).long()
    if label_noise > 0:
        flip = torch.rand(n, generator=generator) < label_noise
        y = torch.where(flip, 1 - y, y)
    return x, y


def train_mlp(
    x: torch.Tensor, y: torch.Tensor, settings: DemoSettings, seed: int
) -> nn.Module:
    """Train a two-hidden-layer tanh MLP (MAP with weight decay from the prior).

    Parameters
    ----------
    x : torch.Tensor
        ``(N, D)``.
    y : torch.Tensor
        ``(N, 1)`` (regression) or ``(N,)`` labels.
    settings : DemoSettings
        Sizes and hyperparameters.
    seed : int
        Initialisation seed.

    Returns
    -------
    torch.nn.Module
        The trained model in eval mode.

    """
    torch.manual_seed(seed)
    regression = settings.task == "regression"
    out = 1 if regression else 2
    h = settings.hidden
    model = nn.Sequential(
        nn.Linear(x.shape[1], h),
        nn.Tanh(),
        nn.Linear(h, h),
        nn.Tanh(),
        nn.Linear(h, out),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(settings.train_steps):
        optimizer.zero_grad()
        f = model(x)
        if regression:
            nll = 0.5 * ((f - y) ** 2).sum() / settings.sigma_noise**2
        else:
            nll = nn.functional.cross_entropy(f, y, reduction="sum")
        reg = (
            0.5
            * settings.prior_precision
            * sum(p.square().sum() for p in model.parameters())
        )
        ((nll + reg) / x.shape[0]).backward()
        optimizer.step()
    return model.eval()


@dataclass
class DemoResult:
    """Everything a demo run produced."""

    settings: DemoSettings
    seed: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    objective: dict[str, float] = field(default_factory=dict)
    optimisation_time: float = math.nan
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    curves: dict[str, torch.Tensor] = field(default_factory=dict)
    locations: dict[str, torch.Tensor] = field(default_factory=dict)
    history: LocationResult | None = None

    def row(self, method: str, locations: str) -> dict[str, Any]:
        """Return the row of a method (``'FunctionalLaplace'``, ...) and locations."""
        for r in self.rows:
            if r["method"] == method and r["locations"] == locations:
                return r
        raise KeyError((method, locations))


def _test_grid(x: torch.Tensor, task: str) -> torch.Tensor:
    if task == "regression":
        return torch.linspace(-5, 5, 200).unsqueeze(1)
    lo, hi = x.min(0).values, x.max(0).values
    g0, g1 = torch.linspace(lo[0], hi[0], 30), torch.linspace(lo[1], hi[1], 30)
    return torch.cartesian_prod(g0, g1)


def _nll(task: str, mean: torch.Tensor, var_or_probs: torch.Tensor, y, sigma) -> float:
    if task == "regression":
        var = var_or_probs.reshape(-1) + sigma**2
        r = (y.reshape(-1) - mean.reshape(-1)) ** 2
        return float((0.5 * (torch.log(2 * math.pi * var) + r / var)).mean())
    p = var_or_probs.clamp_min(1e-12)
    return float(-torch.log(p[torch.arange(len(y)), y]).mean())


def _latent_variance(la: Any, x: torch.Tensor) -> torch.Tensor:
    Js, _ = la.backend.jacobians(x)
    return la.functional_variance(Js).diagonal(dim1=-2, dim2=-1).detach()


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
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _run_demo(task, m, steps, seed, quick, progress_bar)
    finally:
        torch.set_num_threads(previous)


def _run_demo(
    task: str,
    m: int | None,
    steps: int | None,
    seed: int,
    quick: bool,
    progress_bar: bool,
) -> DemoResult:
    s = DemoSettings.for_task(task, m, steps, quick)
    gen = torch.Generator().manual_seed(seed)
    if task == "regression":
        make = lambda n: make_regression_gap(n, gen, s.data_noise)  # noqa: E731
    else:
        make = lambda n: make_moons(n, gen, s.data_noise, s.label_noise)  # noqa: E731
    x, y = make(s.n)
    x_test, y_test = make(max(200, s.n // 2))
    model = train_mlp(x, y, s, seed)
    loader = DataLoader(TensorDataset(x, y), batch_size=256)
    grid = _test_grid(x, task)
    lik = {"sigma_noise": s.sigma_noise, "prior_precision": s.prior_precision}
    result = DemoResult(settings=s, seed=seed, data={"x": x, "y": y, "grid": grid})

    start = time.perf_counter()
    full = Laplace(
        model,
        task,
        subset_of_weights="all",
        hessian_structure="full",
        backend=DiffBackPackGGN,
        **lik,
    )
    full.fit(loader)
    var_full = _latent_variance(full, grid)
    pred = full(x_test, pred_type="glm", link_approx="probit")
    nll_full = _nll(task, *_split(task, pred, model, x_test), y_test, s.sigma_noise)
    result.rows.append(
        {
            "method": "Full GGN Laplace",
            "locations": f"all {s.n}",
            "error": 0.0,
            "nll": nll_full,
            "time": time.perf_counter() - start,
        }
    )
    result.curves["full"] = var_full

    Z_random = random_subset(x, s.m, torch.Generator().manual_seed(seed + 1))
    start = time.perf_counter()
    opt = optimize_locations(
        model,
        task,
        (x, y),
        s.m,
        init=Z_random,
        steps=s.steps,
        lr=s.lr,
        patience=s.patience,
        seed=seed,
        progress_bar=progress_bar,
        **lik,
    )
    result.optimisation_time = time.perf_counter() - start
    result.history = opt
    result.objective = {
        "random": opt.history.initial_objective,
        "optimised": opt.history.final_objective,
    }
    result.locations = {"random": Z_random, "optimised": opt.locations}

    methods = {"FunctionalLaplace": "full", "ContextPosterior": None}
    if task == "classification":
        methods["FunctionalLaplace (diag Λ)"] = "diagonal"
    for name, Z in result.locations.items():
        for method, hessian in methods.items():
            start = time.perf_counter()
            if hessian is not None:
                la = LocationFunctionalLaplace(
                    model, task, Z, reweight=True, output_hessian=hessian, **lik
                )
                la.fit(loader)
                pred = la(x_test, pred_type="gp", link_approx="probit")
            else:
                la = ContextPosterior(model, task, Z, **lik).fit(loader)
                pred = la(x_test, link_approx="probit")
            var = _latent_variance(la, grid)
            elapsed = time.perf_counter() - start
            error = float((var.log() - var_full.log()).abs().mean())
            nll = _nll(task, *_split(task, pred, model, x_test), y_test, s.sigma_noise)
            result.rows.append(
                {
                    "method": method,
                    "locations": f"{name} {s.m}",
                    "error": error,
                    "nll": nll,
                    "time": elapsed,
                }
            )
            result.curves[f"{method}/{name}"] = var
    return result


def _split(task: str, pred: Any, model: nn.Module, x: torch.Tensor) -> tuple:
    if task == "regression":
        mean, var = pred
        return mean.detach(), var.detach().reshape(-1)
    with torch.no_grad():
        return model(x), pred.detach()


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
    h = result.history.history if result.history is not None else None
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


def plot(result: DemoResult, path: str) -> str:
    """Write a PNG comparing the posteriors and the locations.

    Parameters
    ----------
    result : DemoResult
        A finished run.
    path : str
        Output file.

    Returns
    -------
    str
        ``path``.

    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, y, grid = result.data["x"], result.data["y"], result.data["grid"]
    curves, locs = result.curves, result.locations
    if result.settings.task == "regression":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        axes[0].scatter(x[:, 0], y[:, 0], s=4, c="0.6", label="data")
        for name, colour in (("random", "tab:red"), ("optimised", "tab:green")):
            axes[0].plot(
                locs[name][:, 0],
                [-2.2 if name == "random" else -2.4] * len(locs[name]),
                "|",
                ms=12,
                c=colour,
                label=f"{name} locations",
            )
        axes[0].set_title("data and context locations")
        axes[0].legend(fontsize=8)
        g = grid[:, 0]
        axes[1].plot(g, curves["full"].log()[:, 0], "k", lw=2, label="full GGN Laplace")
        for key, style in (
            ("ContextPosterior/random", "r--"),
            ("ContextPosterior/optimised", "g--"),
            ("FunctionalLaplace/random", "r:"),
            ("FunctionalLaplace/optimised", "g:"),
        ):
            axes[1].plot(g, curves[key].log()[:, 0], style, label=key)
        axes[1].set_title("log latent predictive variance")
        axes[1].legend(fontsize=7)
    else:
        fig, axes = plt.subplots(2, 3, figsize=(14, 8))
        n = int(round(math.sqrt(grid.shape[0])))
        g0 = grid[:, 0].reshape(n, n)
        g1 = grid[:, 1].reshape(n, n)
        full_log = curves["full"].log()
        ax = axes[0, 0]
        c = ax.contourf(g0, g1, full_log.mean(-1).reshape(n, n), levels=20)
        fig.colorbar(c, ax=ax)
        ax.scatter(x[:, 0], x[:, 1], c=y, s=3, cmap="coolwarm", alpha=0.5)
        ax.set_title("full GGN Laplace: mean log latent var")
        keys = [
            (axes[0, 1], "FunctionalLaplace", "random"),
            (axes[0, 2], "FunctionalLaplace", "optimised"),
            (axes[1, 1], "ContextPosterior", "random"),
            (axes[1, 2], "ContextPosterior", "optimised"),
        ]
        errors = {
            (method, loc): (curves[f"{method}/{loc}"].log() - full_log).abs().mean(-1)
            for _, method, loc in keys
        }
        top = max(float(e.max()) for e in errors.values()) or 1.0
        levels = torch.linspace(0, top, 21).tolist()
        for ax, method, loc in keys:
            err = errors[(method, loc)]
            c = ax.contourf(g0, g1, err.reshape(n, n), levels=levels, cmap="magma")
            fig.colorbar(c, ax=ax)
            ax.scatter(x[:, 0], x[:, 1], c="0.7", s=2, alpha=0.5)
            ax.scatter(locs[loc][:, 0], locs[loc][:, 1], marker="x", c="c", s=40)
            ax.set_title(
                f"{method}, {loc}: |Δ log var| (mean {err.mean():.3f})", fontsize=9
            )
        ax = axes[1, 0]
        h = result.history.history if result.history is not None else None
        if h is not None:
            ax.semilogy(h.objective)
        ax.set_xlabel("step")
        ax.set_title("Nyström gap (minibatch estimate)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
