"""The context posterior's numerics: the evidence's δ against M, and its speed.

``python benchmarks/context_posterior/context_numerics.py evidence [--quick]``
re-measures the "Hyperparameters by evidence" table (docs/posterior.md) on the
demo's regression (N = 400 with a gap, 1-50-50-1 tanh MLP, σ = 0.1, seed 0): the
prior precision chosen by
``ContextPosterior.optimize_prior_precision(method="marglik")`` with the default
jitter, on M optimised locations (the demo's optimiser from a random start) and
on ``Z = X``, beside laplace-torch's own float64 ``FullLaplace`` maximiser; and
the batch-size spread of the evidence (batch 400 against 16) at each M.

``python benchmarks/context_posterior/context_numerics.py timing [--quick] [--out F]``
times ``fit``, a prediction on 1000 inputs and the evidence (one value, then a
20-value δ search) of the package it imports (one thread, float64, median of
repeats), so that running it with ``PYTHONPATH`` at an older checkout gives the
before/after comparison of ``CONTEXT_NUMERICS.md`` (beside this script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from laplace import FullLaplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import ContextPosterior
from laplace_diffjac.context import random_subset
from laplace_diffjac.examples import DemoSettings
from laplace_diffjac.examples._problem import make_problem

F64 = torch.float64


def _full_delta(problem, grid: torch.Tensor) -> float:
    """laplace-torch's FullLaplace evidence maximised over a fine grid (float64)."""
    model = problem.model.double()
    x, y = problem.x.double(), problem.y.double()
    full = FullLaplace(model, "regression", sigma_noise=problem.sigma_noise)
    full.fit(DataLoader(TensorDataset(x, y), batch_size=400))
    values = [float(full.log_marginal_likelihood(d.reshape(1))) for d in grid]
    return float(grid[max(range(len(values)), key=values.__getitem__)])


def evidence_table(quick: bool) -> list[dict]:
    settings = DemoSettings.for_task("regression", None, 60 if quick else None, quick)
    problem = make_problem(settings, 0)
    rows = []
    sizes = [8, 16] if quick else [8, 16, 32, 64, 128]
    for m in [*sizes, "Z = X"]:
        if m == "Z = X":
            Z = problem.x
        else:
            start = random_subset(problem.x, m, torch.Generator().manual_seed(2))
            Z = problem.optimized_locations(m, start, 0, False).locations
        row: dict = {"M": m}
        try:
            cp = ContextPosterior(problem.model, "regression", Z, sigma_noise=0.1)
            cp.fit(problem.loader)
            cp.optimize_prior_precision(method="marglik")
            row["delta"] = float(cp.prior_precision)
            small = ContextPosterior(problem.model, "regression", Z, sigma_noise=0.1)
            small.fit(DataLoader(problem.loader.dataset, batch_size=16))
            p = cp.prior_precision
            a = float(cp.log_marginal_likelihood(p))
            b = float(small.log_marginal_likelihood(p))
            row["batch_spread"] = abs(a - b) / abs(a)
        except Exception as err:  # noqa: BLE001 - reported in the table
            row["error"] = f"{type(err).__name__}: {err}"[:80]
        rows.append(row)
    grid = torch.logspace(-1.3, -0.3, 21 if quick else 201, dtype=F64)  # 0.05-0.5
    rows.append({"M": "full (laplace-torch)", "delta": _full_delta(problem, grid)})
    return rows


def _timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _timing_row(n: int, m: int, c: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, c)
    ).to(F64)
    x, y = torch.randn(n, 2, dtype=F64), torch.randn(n, c, dtype=F64)
    xs, z = torch.randn(1000, 2, dtype=F64), x[:m]
    loader = DataLoader(TensorDataset(x, y), batch_size=256)
    cp = ContextPosterior(model, "regression", z).fit(loader)
    grid = torch.logspace(-2, 2, 20, dtype=F64)

    def search():
        for d in grid:
            cp.log_marginal_likelihood(d.reshape(1))

    def one_evidence():
        fresh = ContextPosterior(model, "regression", z)
        fresh._acc, fresh._groups = cp._acc, cp._groups
        fresh.log_marginal_likelihood()

    def fit():
        ContextPosterior(model, "regression", z).fit(loader)

    return {
        "N": n, "M": m, "C": c,
        "fit": _timed(fit, repeats),
        "predict": _timed(lambda: cp(xs), repeats),
        "evidence": _timed(one_evidence, repeats),
        "search": _timed(search, repeats),
    }  # fmt: skip


def timing(quick: bool) -> list[dict]:
    torch.set_num_threads(1)
    if quick:
        return [_timing_row(500, 16, 1, 1)]
    return [_timing_row(2000, m, c, 5) for m, c in [(32, 1), (128, 1), (32, 3)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["evidence", "timing"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = evidence_table(args.quick) if args.part == "evidence" else timing(args.quick)
    text = json.dumps(rows, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
