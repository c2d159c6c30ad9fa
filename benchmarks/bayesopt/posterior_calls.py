"""What one acquisition evaluation costs: ``ContextBoTorch`` beside ``LaplaceBoTorch``.

L-BFGS-B calls the acquisition function hundreds of times per Bayesian-
optimisation iteration, each time with a gradient in the candidates, and at
these sizes (a 2×50 tanh network, tens of observations) every call is bound by
Python and kernel launches, not by multiply-adds. This benchmark times, on one
thread and on the same observations:

- **acquisition**: log-EI (q = 1) or qLogEI (q = 4) of ``(restarts, q, d)``
  candidates and its gradient, what ``optimize_acqf`` evaluates;
- **posterior**: ``model.posterior`` of the same candidates, then the gradient
  of its mean and covariance.

Rows: ``ContextBoTorch`` at its defaults (predictions from the Linear layers'
inputs and signals, issue #44's acquisition time), the same fitted surrogate
with that route switched off (the Jacobians of the candidates, the route
before it; the switch is the posterior's private ``_linear``), and
laplace-bayesopt's ``LaplaceBoTorch``. The methods take turns in each of
``--rounds`` rounds; the report gives the median over rounds of each round's
median per call, and per step the largest relative difference between the two
``ContextBoTorch`` routes' values and gradients on one acquisition object (they
must agree to rounding; log-EI's gradient amplifies it most).

Run: ``python benchmarks/bayesopt/posterior_calls.py [--rounds 7] [--out
benchmarks/bayesopt/POSTERIOR_CALLS.md]``; ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bayesopt as bo  # noqa: E402

METHODS = ("ContextBoTorch", "ContextBoTorch, Jacobian route", "LaplaceBoTorch")
FUNCTIONS = ("branin", "rosenbrock", "hartmann", "styblinski_tang", "griewank")


@dataclass(frozen=True)
class Settings:
    """One run's sizes (recorded in the results)."""

    functions: tuple[str, ...] = FUNCTIONS
    batch_sizes: tuple[int, ...] = (1, 4)
    observations: int = 16
    restarts: int = 5
    rounds: int = 7
    calls: int = 40
    warmup: int = 10
    seed: int = 0
    epochs: int = 1000
    width: int = 50


QUICK = Settings(
    functions=("branin",),
    batch_sizes=(1, 2),
    observations=6,
    restarts=2,
    rounds=1,
    calls=3,
    warmup=1,
    epochs=20,
    width=8,
)


def _surrogates(function: str, s: Settings) -> dict[str, Any]:
    """Both fitted surrogates on the seed's Sobol design, outcomes standardised."""
    problem = bo._problem(function)
    X, Y, _ = bo.initial_design(problem, s.observations, s.seed)
    Ys = (Y - Y.mean()) / Y.std()
    cfg = replace(
        bo.Config(),
        epochs=s.epochs,
        width=s.width,
        outcomes="caller",
        marglik_iters=bo.Config.marglik_iters if s.epochs >= 100 else 5,
    )
    torch.manual_seed(s.seed)
    context = bo._surrogate("ContextBoTorch", X, Ys, cfg, s.seed).model
    torch.manual_seed(s.seed)
    laplace = bo._surrogate("LaplaceBoTorch", X, Ys, cfg, s.seed).model
    return {
        "context": context,
        "laplace": laplace,
        "best": Ys.max(),
        "dim": X.shape[-1],
    }


@contextlib.contextmanager
def _jacobian_route(model) -> Iterator[None]:
    """``model``'s context posterior without its Linear layers' route, then with."""
    posterior = model.context_posterior
    kept = posterior._linear
    posterior._linear = None
    try:
        yield
    finally:
        posterior._linear = kept


def _route(method: str, model) -> contextlib.AbstractContextManager:
    """The route ``method`` names, for the duration of a block."""
    return _jacobian_route(model) if "Jacobian" in method else contextlib.nullcontext()


def _steps(model, best: torch.Tensor, candidates: torch.Tensor, q: int):
    """The two timed steps on ``model``: acquisition and posterior, with gradients."""
    from botorch.acquisition import LogExpectedImprovement, qLogExpectedImprovement

    acqf = (
        LogExpectedImprovement(model, best_f=best)
        if q == 1
        else qLogExpectedImprovement(model, best_f=best)
    )

    def acquisition() -> list[torch.Tensor]:
        X = candidates.clone().requires_grad_(True)
        value = acqf(X).sum()
        (grad,) = torch.autograd.grad(value, X)
        return [value.detach(), grad]

    def posterior() -> list[torch.Tensor]:
        X = candidates.clone().requires_grad_(True)
        mvn = model.posterior(X).mvn
        mean, cov = mvn.mean, mvn.covariance_matrix
        (grad,) = torch.autograd.grad(mean.sum() + (cov * cov).sum(), X)
        return [mean.detach(), cov.detach(), grad]

    return {"acquisition": acquisition, "posterior": posterior}


def _median_call(fn: Callable[[], Any], calls: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        float((x - y).abs().max() / y.abs().max().clamp_min(1e-300))
        for x, y in zip(a, b)
    )


def measure(function: str, q: int, s: Settings) -> dict[str, Any]:
    """Median seconds per call of every method and step, and the routes' agreement."""
    fitted = _surrogates(function, s)
    gen = torch.Generator().manual_seed(s.seed + 1)
    candidates = torch.rand(s.restarts, q, fitted["dim"], generator=gen).double()
    models = {
        "ContextBoTorch": fitted["context"],
        "ContextBoTorch, Jacobian route": fitted["context"],
        "LaplaceBoTorch": fitted["laplace"],
    }
    steps = {m: _steps(models[m], fitted["best"], candidates, q) for m in METHODS}
    seconds: dict[str, dict[str, list[float]]] = {
        m: {"acquisition": [], "posterior": []} for m in METHODS
    }
    for _ in range(s.rounds):
        for method in METHODS:
            with _route(method, models[method]):
                for step, fn in steps[method].items():
                    seconds[method][step].append(_median_call(fn, s.calls, s.warmup))
    # the same acquisition object (its Monte Carlo base samples) on both routes
    linear = {k: fn() for k, fn in steps["ContextBoTorch"].items()}
    with _jacobian_route(fitted["context"]):
        jacobian = {k: fn() for k, fn in steps["ContextBoTorch"].items()}
    return {
        "function": function,
        "dim": fitted["dim"],
        "q": q,
        "seconds": {
            m: {k: statistics.median(v) for k, v in per.items()}
            for m, per in seconds.items()
        },
        "routes_differ_by": {
            k: _relative_difference(linear[k], jacobian[k]) for k in linear
        },
    }


def report(record: dict[str, Any]) -> str:
    """The Markdown report of a run's record."""
    s = record["settings"]
    lines = [
        "# One acquisition evaluation: ContextBoTorch beside LaplaceBoTorch",
        "",
        f"Generated by `python benchmarks/bayesopt/posterior_calls.py` on "
        f"{record['date']} ({record['platform']}, torch {record['torch']}, one "
        f"thread). {s['observations']} observations (the seed's Sobol design, "
        f"outcomes standardised), a 2×{s['width']} tanh network trained "
        f"{s['epochs']} epochs, {s['restarts']} restarts of q candidates; median "
        f"over {s['rounds']} interleaved rounds of each round's median of "
        f"{s['calls']} calls. *acquisition*: log-EI (q = 1) or qLogEI and its "
        "gradient in the candidates; *posterior*: `model.posterior`, then the "
        "gradient of its mean and covariance. *ContextBoTorch, Jacobian route*: "
        "the same fitted surrogate with its Linear layers' route switched off.",
        "",
        "| function | d | q | step | ContextBoTorch (ms) | Jacobian route (ms) "
        "| LaplaceBoTorch (ms) | ÷ Jacobian route | ÷ LaplaceBoTorch "
        "| routes differ by |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        t = row["seconds"]
        for step in ("acquisition", "posterior"):
            ours = t["ContextBoTorch"][step]
            jac = t["ContextBoTorch, Jacobian route"][step]
            lap = t["LaplaceBoTorch"][step]
            lines.append(
                f"| {row['function']} | {row['dim']} | {row['q']} | {step} "
                f"| {1e3 * ours:.2f} | {1e3 * jac:.2f} | {1e3 * lap:.2f} "
                f"| {ours / jac:.2f}× | {ours / lap:.2f}× "
                f"| {row['routes_differ_by'][step]:.1e} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--functions", nargs="+", choices=bo.FUNCTIONS)
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "POSTERIOR_CALLS.md")
    )
    args = parser.parse_args(argv)
    s = QUICK if args.quick else Settings()
    if args.rounds:
        s = replace(s, rounds=args.rounds)
    if args.functions:
        s = replace(s, functions=tuple(args.functions))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # BoTorch's and laplace-torch's notes
    rows = []
    for function in s.functions:
        for q in s.batch_sizes:
            rows.append(measure(function, q, s))
            print(f"done {function} q = {q}", flush=True)
    record = {
        "date": datetime.date.today().isoformat(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "settings": asdict(s),
        "rows": rows,
    }
    out = pathlib.Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    out.write_text(report(record))
    print(report(record))


if __name__ == "__main__":
    main()
