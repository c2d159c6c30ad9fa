"""``ContextPosterior``'s fit and prediction: per-layer factors against Jacobians.

The issue's case: a tanh MLP 20-256-256-10 written as a class (P = 73,738),
M = 128 locations, C = 10 outputs, N = 2,000 training points, regression, float64
sums, ``DiffBackPackGGN``. Routes:

* ``factors``: the default (``structured=True``): every Gram, the GGN diagonal
  and the dual mean from the engine's per-layer factors, neither ``J_Z``
  (M·C × P) nor a batch's ``J`` formed;
* ``jacobians``: ``structured=False``, forming the Jacobians as the package did
  before (the locations' whitened Jacobians kept, ``G J_bᵀ`` per batch).

Each route runs in its own process (so its peak resident memory is its own) and
times, in that process, ``fit`` (one pass over the data), one prediction
``cp(x*)`` at 256 test inputs with the dual mean, and ``log_marginal_likelihood``;
its peak resident memory is reported whole (``peak_rss_gib``, imports included)
and as the work's own (``added_peak_gib``: the high-water mark of fit, prediction
and evidence above the resident memory just before ``fit``).
The predictive variances and the evidence of the two routes are compared (``max
relative difference``), so a fast wrong route shows. ``LocationFunctionalLaplace``
on the same locations is measured the same way, each route in its own process
(``functional-factors``: ``structured=True``, ``K_MM`` and the test inputs'
kernels from per-layer factors; ``functional-jacobians``: laplace-torch's
``fit`` and prediction through the locations' and the test inputs' Jacobians):
``fit`` and one prediction ``la(x*)``. Data: synthetic (seeded
normal inputs, the network's own outputs plus noise as targets).

Run: ``python benchmarks/context_posterior/context_routes.py [--quick | --size
{issue,large}] [--routes ...] [--out PATH]``; the results go to
``context_routes.json`` (``--size large``: ``context_routes_large.json``) beside
this script (``--quick`` writes only where ``--out`` says).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from laplace_diffjac import ContextPosterior

ROUTES = ("factors", "jacobians")
FUNCTIONAL_ROUTES = ("functional-factors", "functional-jacobians")


class ClassMLP(nn.Module):
    """A tanh MLP written as a class (not ``nn.Sequential``)."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


#: ``quick``: smoke sizes; ``issue``: issue #28's case (P = 73,738, M = 128);
#: ``large``: its larger one (20-384-384-10, P = 159,754, M = 256).
CASES = {
    "quick": {"widths": [20, 32, 32, 10], "M": 16, "N": 200, "n_test": 32},
    "issue": {"widths": [20, 256, 256, 10], "M": 128, "N": 2000, "n_test": 256},
    "large": {"widths": [20, 384, 384, 10], "M": 256, "N": 2000, "n_test": 256},
}


def _case(size: str) -> dict:
    return CASES[size]


def _problem(
    size: str,
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The seeded model, data ``(x, y)``, locations ``z`` and test inputs ``xs``.

    Also sets two threads. Data: seeded normal inputs, the network's own outputs
    plus noise as targets; the locations are the first ``M`` inputs.
    """
    torch.set_num_threads(2)
    case = _case(size)
    torch.manual_seed(0)
    model = ClassMLP(case["widths"]).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(case["N"], case["widths"][0], generator=gen)
    with torch.no_grad():
        y = model(x) + 0.1 * torch.randn(case["N"], case["widths"][-1], generator=gen)
    z = x[: case["M"]].clone()
    xs = torch.randn(case["n_test"], case["widths"][0], generator=gen)
    return model, x, y, z, xs


def _run_route(route: str, size: str, out: Path) -> dict:
    """One route in this process: times, peak memory; saves its numbers to ``out``."""
    model, x, y, z, xs = _problem(size)
    cp = ContextPosterior(
        model, "regression", z, sigma_noise=0.1, prior_precision=1.0,
        predictive_mean="dual", structured=route == "factors",
    )  # fmt: skip
    before = _reset_peak_kib()  # the work's own peak: imports, model, data excluded
    start = time.perf_counter()
    cp.fit((x, y))
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    mean, var = cp(xs)
    predict_s = time.perf_counter() - start
    start = time.perf_counter()
    evidence = cp.log_marginal_likelihood()
    evidence_s = time.perf_counter() - start
    added = (_status_kib("VmHWM") - before) / 2**20  # KiB → GiB
    torch.save({"mean": mean, "var": var, "evidence": evidence}, out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB
    return {
        "fit_s": fit_s,
        "predict_s": predict_s,
        "evidence_s": evidence_s,
        "peak_rss_gib": peak,
        "added_peak_gib": added,
        "rss_before_fit_gib": before / 2**20,
        "n_params": sum(p.numel() for p in model.parameters()),
    }


def _run_functional(route: str, size: str, out: Path) -> dict:
    """``LocationFunctionalLaplace`` fit and one prediction, in this process."""
    from torch.utils.data import DataLoader, TensorDataset

    from laplace_diffjac import LocationFunctionalLaplace

    model, x, y, z, xs = _problem(size)
    la = LocationFunctionalLaplace(
        model, "regression", z, sigma_noise=0.1, prior_precision=1.0,
        structured=route == "functional-factors",
    )  # fmt: skip
    before = _reset_peak_kib()
    start = time.perf_counter()
    la.fit(DataLoader(TensorDataset(x, y), batch_size=256))
    fit_s = time.perf_counter() - start
    fit_peak = (_status_kib("VmHWM") - before) / 2**20
    before_predict = _reset_peak_kib()
    start = time.perf_counter()
    mean, var = la(xs, pred_type="gp")
    predict_s = time.perf_counter() - start
    predict_peak = (_status_kib("VmHWM") - before_predict) / 2**20
    torch.save({"mean": mean, "var": var}, out)
    return {
        "fit_s": fit_s,
        "predict_s": predict_s,
        "fit_added_peak_gib": fit_peak,
        "predict_added_peak_gib": predict_peak,
        "n_params": sum(p.numel() for p in model.parameters()),
    }


def _status_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process from ``/proc``, KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_kib() -> int:
    """Reset the peak RSS to the current one (Linux ``clear_refs``); return it, KiB.

    The reset peak (``VmHWM``), not ``VmRSS``: the kernel syncs its RSS counters
    lazily, and a difference of one counter cannot go negative.
    """
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmHWM")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="--size quick")
    parser.add_argument("--size", choices=sorted(CASES), default="issue")
    parser.add_argument(
        "--routes",
        nargs="+",
        choices=ROUTES + FUNCTIONAL_ROUTES,
        default=list(ROUTES + FUNCTIONAL_ROUTES),
        help="a subset (ratios need both routes of a pair)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--route", choices=ROUTES + FUNCTIONAL_ROUTES, help=argparse.SUPPRESS
    )
    parser.add_argument("--numbers", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = "quick" if args.quick else args.size
    if args.route:  # a child process: one route
        run = _run_functional if args.route in FUNCTIONAL_ROUTES else _run_route
        print(json.dumps(run(args.route, size, Path(args.numbers))))
        return
    results, numbers = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for route in args.routes:
            path = Path(tmp) / f"{route}.pt"
            command = [sys.executable, str(Path(__file__).resolve())]
            command += ["--route", route, "--numbers", str(path), "--size", size]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results[route] = json.loads(done.stdout.strip().splitlines()[-1])
            numbers[route] = torch.load(path)
    report = {
        "case": _case(size),
        "routes": results,
        **_comparisons(results, numbers),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": 2,
            "cpu": platform.processor() or platform.machine(),
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    default = {
        "quick": None,
        "issue": Path(__file__).with_suffix(".json"),
        "large": Path(__file__).with_name("context_routes_large.json"),
    }[size]
    out = args.out or default
    if out:
        Path(out).write_text(text + "\n")


def _comparisons(results: dict, numbers: dict) -> dict:
    """Agreement and time/memory ratios of each pair of routes that both ran."""
    report: dict = {}
    if all(route in results for route in ROUTES):
        ref, ours = numbers["jacobians"], numbers["factors"]
        report["max relative difference, factors vs jacobians"] = {
            key: _relative(ours[key], ref[key]) for key in ("mean", "var", "evidence")
        }
        fast, slow = results["factors"], results["jacobians"]
        keys = ("fit_s", "predict_s", "evidence_s", "peak_rss_gib", "added_peak_gib")
        report["ratios (jacobians / factors)"] = {
            key: slow[key] / fast[key] for key in keys
        }
    if all(route in results for route in FUNCTIONAL_ROUTES):
        ours, ref = (numbers[route] for route in FUNCTIONAL_ROUTES)
        report["LocationFunctionalLaplace, max relative difference"] = {
            key: _relative(ours[key], ref[key]) for key in ("mean", "var")
        }
        fast, slow = (results[route] for route in FUNCTIONAL_ROUTES)
        keys = ("fit_s", "predict_s", "fit_added_peak_gib", "predict_added_peak_gib")
        report["LocationFunctionalLaplace ratios (jacobians / factors)"] = {
            key: slow[key] / fast[key] for key in keys
        }
    return report


if __name__ == "__main__":
    main()
