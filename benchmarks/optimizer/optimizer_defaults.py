"""Measure the location optimiser's defaults: minibatch size and threads.

``python benchmarks/optimizer/optimizer_defaults.py minibatch [--quick]``: on the demo's
regression (N = 400 with a gap, 1-50-50-1 tanh, M = 16) and on two moons
(2-50-50-2, M = 16), and with ``--digits`` on scikit-learn's digits (N = 1257,
64-50-50-10, M = 126; needs the ``study`` extra), for minibatch sizes 32-256:
CPU seconds per step (one thread, median), the minibatch estimate's relative
standard deviation at the initial locations (the objective's noise), and the
full-data Nyström gap after 200 steps (same seed, the default learning rate)
relative to the initial gap.

``python benchmarks/optimizer/optimizer_defaults.py threads [--quick]``: 100 steps on a
small problem (N = 300, 2-32-32-1, M = 16) and on the demo's regression with
M = 64, each in a fresh process, with PyTorch's default threads, with
``torch.set_num_threads(1)``, and with ``OMP_NUM_THREADS=1``, on a quiet machine
and with two busy processes competing for the cores; CPU and wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from laplace_diffjac import optimize_locations
from laplace_diffjac.backends import as_backend
from laplace_diffjac.context import nystrom_gap, random_subset
from laplace_diffjac.examples import DemoSettings
from laplace_diffjac.examples._problem import make_problem
from laplace_diffjac.kernels import output_hessians


def _problem(name: str):
    if name == "digits":
        from sklearn.datasets import load_digits

        X, y = load_digits(return_X_y=True)
        X = (X - X.mean(0)) / (X.std(0) + 1e-8)
        perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
        x = torch.tensor(X, dtype=torch.float32)[perm[: int(0.7 * len(X))]]
        t = torch.tensor(y)[perm[: int(0.7 * len(X))]]
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 50), torch.nn.Tanh(), torch.nn.Linear(50, 50),
            torch.nn.Tanh(), torch.nn.Linear(50, 10),
        )  # fmt: skip
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(150):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), t).backward()
            opt.step()
        return model.eval(), x, "classification", 126
    task = "regression" if name == "regression" else "classification"
    problem = make_problem(DemoSettings.for_task(task, 16, None, False), 0)
    return problem.model, problem.x, task, 16


def _gap(model, task: str, xb: torch.Tensor, Z: torch.Tensor, n: int) -> float:
    backend = as_backend(model, task, None)
    with torch.no_grad():
        lam = output_hessians(model(xb).double(), task)
    return float(nystrom_gap(backend, xb, Z, lam, n_data=n))


def _minibatch_row(name: str, batch: int, steps: int) -> dict:
    torch.set_num_threads(1)
    model, x, task, m = _problem(name)
    Z0 = random_subset(x, m, torch.Generator().manual_seed(1))
    kw = dict(init=Z0, patience=0, progress_bar=False, seed=0, evaluate_full=True)
    start = time.process_time()
    res = optimize_locations(model, task, x, m, steps=steps, batch_size=batch, **kw)
    per_step = (time.process_time() - start) / max(steps, 1)
    full0 = res.history.initial_objective
    draws = []
    for seed in range(20):
        idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        draws.append(_gap(model, task, x[idx[:batch]], Z0, len(x)))
    return {
        "problem": name, "batch": batch, "cpu_s_per_step": per_step,
        "noise": statistics.pstdev(draws) / full0,
        "gap_ratio": res.history.final_objective / full0,
    }  # fmt: skip


def minibatch(args) -> list[dict]:
    names = ["regression", "moons"] + (["digits"] if args.digits else [])
    batches = [32, 64] if args.quick else [32, 64, 128, 256]
    steps = 5 if args.quick else 200
    return [_minibatch_row(n, b, steps) for n in names for b in batches]


_CHILD = """
import sys, time, torch
from laplace_diffjac import optimize_locations
from optimizer_defaults import _small, _problem
if sys.argv[1] == "one": torch.set_num_threads(1)
model, x, task, m = _small() if sys.argv[2] == "small" else _problem("regression")
m = 16 if sys.argv[2] == "small" else 64
c, w = time.process_time(), time.perf_counter()
optimize_locations(model, task, x, m, steps=int(sys.argv[3]), patience=0,
                   progress_bar=False, init="random")
print(time.process_time() - c, time.perf_counter() - w)
"""


def _small():
    torch.manual_seed(0)
    x = torch.randn(300, 2)
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
        torch.nn.Tanh(), torch.nn.Linear(32, 1),
    )  # fmt: skip
    return model, x, "regression", 16


def _run_child(mode: str, size: str, steps: int) -> tuple[float, float]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if mode == "omp1":
        env["OMP_NUM_THREADS"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))  # the child imports this module
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, size, str(steps)],
        env=env, cwd=here, capture_output=True, text=True, check=True, timeout=900,
    )  # fmt: skip
    cpu, wall = out.stdout.split()[-2:]
    return float(cpu), float(wall)


def threads(args) -> list[dict]:
    steps = 10 if args.quick else 100
    rows = []
    for load in [False] if args.quick else [False, True]:
        busy = []
        if load:
            loop = "import time\nt = time.time()\nwhile time.time() - t < 600: pass"
            busy = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(2)]
        try:
            for size in ["small", "regression"]:
                for mode in ["default", "one", "omp1"]:
                    cpu, wall = _run_child(mode, size, steps)
                    rows.append({"load": load, "problem": size, "threads": mode,
                                 "cpu_s": cpu, "wall_s": wall})  # fmt: skip
        finally:
            for p in busy:
                p.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["minibatch", "threads"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--digits", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = minibatch(args) if args.part == "minibatch" else threads(args)
    text = json.dumps(rows, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
