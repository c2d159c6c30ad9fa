"""One acquisition of the BO benchmark, evaluation by evaluation.

``bayesopt.py`` counts how often BoTorch's optimiser calls each surrogate; this
script shows where those calls go. For one function and seed it draws the same
design, builds each ``--methods`` surrogate as ``bayesopt.py`` does and runs the
first acquisition with the same ``optimize_acqf`` settings, recording every
L-BFGS-B evaluation (the raw samples' scoring is not traced): how many restarts
were still running (BoTorch's batched L-BFGS-B evaluates the unconverged ones
together, so the calls are the slowest restart's), the best acquisition value
seen so far, and the share of the chosen points' coordinates on the cube's
faces. The report gives the best value after 100, 250, 500 and 1,000
evaluations and at the end: how much the last evaluations still gain.

Usage::

    python benchmarks/bayesopt/acquisition_trace.py   # ACQUISITION_TRACE.md, here
    python benchmarks/bayesopt/acquisition_trace.py --quick --out DIR

The defaults are the many-observation regime's first batch, seed 1 (20-D
Griewank, 200 initial points, q = 25, raw samples scored 16 at a time, BoTorch's
default limit of 2,000 iterations per restart).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import warnings
from dataclasses import asdict, replace

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bayesopt.py, whose design and surrogates these are

import bayesopt  # noqa: E402

#: After how many evaluations the report gives the best value seen.
MILESTONES = (100, 250, 500, 1000)
#: The ``bayesopt.Config`` fields the command line may set.
OVERRIDES = ("initial", "q", "batch_limit", "maxiter")


def trace(method: str, function: str, seed: int, cfg: bayesopt.Config) -> dict:
    """The first acquisition of one task, evaluation by evaluation.

    Returns
    -------
    dict
        ``active``, ``best`` and ``faces`` per evaluation with a gradient (the
        restarts evaluated, the best value seen so far, the faces share of the
        evaluation's best restart), the posterior-call counts, the candidates'
        faces share and the process seconds of the fit and the acquisition.
    """
    torch.set_num_threads(1)
    problem = bayesopt._problem(function)
    dim = problem.dim
    X, Y, _ = bayesopt.initial_design(problem, cfg.initial, seed)
    torch.manual_seed(seed)
    t = time.process_time()
    surrogate = bayesopt._surrogate(method, X, Y, cfg, seed)
    fit_s = time.process_time() - t
    evaluations: list[tuple[torch.Tensor, torch.Tensor]] = []
    t = time.process_time()
    candidate, counts = bayesopt._acquire(
        surrogate.model, Y.max(), dim, cfg, trace=evaluations
    )
    acq_s = time.process_time() - t
    active, best, faces = [], [], []
    best_so_far = -float("inf")
    for points, values in evaluations:
        top = int(values.argmax())
        best_so_far = max(best_so_far, float(values[top]))
        active.append(points.shape[0])
        best.append(best_so_far)
        faces.append(bayesopt.on_faces(points[top]))
    return {
        "method": method,
        "function": function,
        "seed": seed,
        "active": active,
        "best": best,
        "faces": faces,
        "calls": asdict(counts),
        "candidate_on_faces": bayesopt.on_faces(candidate),
        "fit_s": fit_s,
        "acq_s": acq_s,
    }


def markdown(records: list[dict], command: str) -> str:
    """The report: per method, the best value over the evaluations."""
    head = " | ".join(f"best after {m}" for m in MILESTONES)
    lines = [
        "# One acquisition, evaluation by evaluation",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC). "
        "Evaluations: the optimiser's, with a gradient (raw-sample scoring "
        "excluded); one restart running: evaluations after all but the slowest "
        "restart stopped; best: the largest acquisition value seen so far "
        "(log expected improvement); faces: share of the final candidates' "
        "coordinates on the cube's faces.",
        "",
        f"| method | evaluations | one restart running | {head} | final best "
        "| faces | acquisition s |",
        "|---|---|---|" + "---|" * len(MILESTONES) + "---|---|---|",
    ]
    for r in records:
        n = len(r["best"])
        alone = sum(a == 1 for a in r["active"])
        at = [f"{r['best'][m - 1]:.4f}" if m <= n else "–" for m in MILESTONES]
        final = f"{r['best'][-1]:.4f}" if n else "–"
        lines.append(
            f"| {r['method']} | {n} | {alone} | {' | '.join(at)} | {final} | "
            f"{100 * r['candidate_on_faces']:.0f} % | {r['acq_s']:.1f} |"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> None:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=HERE)
    parser.add_argument("--function", default="griewank", choices=bayesopt.FUNCTIONS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=bayesopt.METHODS,
        default=["ContextBoTorch", "ContextBoTorch(factors)", "LaplaceBoTorch"],
    )
    for field in OVERRIDES:
        parser.add_argument("--" + field.replace("_", "-"), type=int)
    args = parser.parse_args(argv)
    if args.quick:
        cfg = replace(bayesopt.QUICK, q=2)
        function = "branin"
    else:
        cfg = replace(bayesopt.Config(), initial=200, q=25, batch_limit=16)
        function = args.function
    given = {k: v for k in OVERRIDES if (v := getattr(args, k)) is not None}
    cfg = replace(cfg, **given)
    records = []
    with warnings.catch_warnings():  # BoTorch's restarts report ABNORMAL stops
        warnings.simplefilter("ignore")
        for method in args.methods:
            records.append(trace(method, function, args.seed, cfg))
    command = " ".join(
        ["python", "benchmarks/bayesopt/acquisition_trace.py", *sys.argv[1:]]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"command": command, "config": asdict(cfg), "records": records}
    (args.out / "acquisition_trace.json").write_text(json.dumps(result))
    (args.out / "ACQUISITION_TRACE.md").write_text(markdown(records, command))


if __name__ == "__main__":
    main()
