"""The cost model of ``ntk``'s route choice, fitted and checked on this device.

For an MLP written as a class, an 8×8 CNN and a token transformer (the cases of
``ntk_routes.py``, at width 32) and batches of 1 to 64, both routes' whole step
(``ntk(x, x)`` and the gradient of ``Σ K²``) is counted
(``laplace_diffjac/kernels/_route_costs.py``: kernels, views, multiply-adds,
bytes) and timed (median of interleaved rounds). The four constants of

    seconds = kernels·t_kernel + views·t_view + madds / rate + bytes / bandwidth

are fitted, non-negative, to the two routes' time *differences* (what the choice
needs; the package's per-call Python, the same for both routes, cancels), each
case weighted by its time. The report gives the fitted constants beside the
package's (``device_costs``), every case's measured difference and the one
predicted from the counts at that batch, the route ``ntk``'s default took (from
its own counts at up to eight inputs, extrapolated), and whether it was the
faster.

Run: ``python benchmarks/jacobians/route_costs.py [--quick] [--device cuda]
[--out FILE.json] [--markdown FILE.md]`` (its recorded run: ``ROUTE_COSTS.md``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, ROOT]

import torch  # noqa: E402
from measure import synchronized  # noqa: E402
from ntk_routes import (  # noqa: E402
    ClassMLP,
    SmallCNN,
    TinyTransformer,
    _route_taken,
    _step,
)
from torch import nn  # noqa: E402

from laplace_diffjac import DiffBackPackGGN  # noqa: E402
from laplace_diffjac.kernels import ntk  # noqa: E402
from laplace_diffjac.kernels._route_costs import (  # noqa: E402
    DeviceCosts,
    Work,
    count_work,
    device_costs,
)

ROUTES = {"factors": True, "jacobians": False}
FIELDS = ("kernels", "views", "madds", "bytes")


def _cases(batch: int) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    chain = nn.Sequential(
        nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10)
    )
    gen = torch.Generator().manual_seed(1)
    return {
        "MLP 20-32-32-10 (class)": (
            ClassMLP(chain),
            torch.randn(batch, 20, generator=gen),
        ),
        "CNN 1×8×8": (SmallCNN(), torch.randn(batch, 1, 8, 8, generator=gen)),
        "transformer, T = 16": (
            TinyTransformer().eval(),
            torch.randint(0, 1000, (batch, 16), generator=gen),
        ),
    }


def measure(batches: list[int], rounds: int, device: torch.device) -> list[dict]:
    """Every case and batch: both routes' counted work and median seconds."""
    rows = []
    for batch in batches:
        for name, (model, x) in _cases(batch).items():
            model, x = model.to(device), x.to(device)
            backend = DiffBackPackGGN(model, "classification")
            steps = {
                route: synchronized(
                    lambda b=backend, s=structured, x=x: _step(
                        lambda z: ntk(b, z, structured=s), x
                    ),
                    device,
                )
                for route, structured in ROUTES.items()
            }
            for step in steps.values():
                step()
            work = {route: count_work(step) for route, step in steps.items()}
            times: dict[str, list[float]] = {route: [] for route in steps}
            for _ in range(rounds):
                for route, step in steps.items():
                    start = time.perf_counter()
                    step()
                    times[route].append(time.perf_counter() - start)
            rows.append(
                {
                    "case": name,
                    "batch": batch,
                    "took": _route_taken(model, x),
                    **{
                        route: {
                            "seconds": statistics.median(times[route]),
                            **{f: getattr(work[route], f) for f in FIELDS},
                        }
                        for route in steps
                    },
                }
            )
            print(name, batch, {r: rows[-1][r]["seconds"] for r in steps}, flush=True)
    return rows


def _difference(row: dict) -> list[float]:
    return [float(row["factors"][f] - row["jacobians"][f]) for f in FIELDS]


def fit(rows: list[dict]) -> list[float]:
    """Non-negative least squares of the time differences, weighted by time.

    Four unknowns: every subset of them is solved by least squares and the best
    one whose solution is non-negative kept (an exact NNLS for so few).
    """
    weights = [1 / (r["factors"]["seconds"] + r["jacobians"]["seconds"]) for r in rows]
    A = torch.tensor(
        [[w * d for d in _difference(r)] for r, w in zip(rows, weights)],
        dtype=torch.float64,
    )
    y = torch.tensor(
        [
            w * (r["factors"]["seconds"] - r["jacobians"]["seconds"])
            for r, w in zip(rows, weights)
        ],
        dtype=torch.float64,
    )
    scale = A.abs().amax(0).clamp_min(1e-300)
    best, best_residual = [0.0] * len(FIELDS), float((y**2).sum())
    for k in range(1, len(FIELDS) + 1):
        for subset in itertools.combinations(range(len(FIELDS)), k):
            cols = list(subset)
            sol = torch.linalg.lstsq(A[:, cols] / scale[cols], y[:, None]).solution
            coef = sol[:, 0] / scale[cols]
            if (coef < 0).any():
                continue
            residual = float(((A[:, cols] @ coef - y) ** 2).sum())
            if residual < best_residual:
                best_residual = residual
                best = [0.0] * len(FIELDS)
                for c, v in zip(cols, coef.tolist()):
                    best[c] = v
    return best


def _predicted(row: dict, costs: DeviceCosts) -> float:
    work = {
        route: Work(*(row[route][f] for f in FIELDS))
        for route in ("factors", "jacobians")
    }
    return costs.seconds(work["factors"]) - costs.seconds(work["jacobians"])


def render(results: dict) -> str:
    """The Markdown report of a run (its ``--out`` JSON)."""
    fitted, package = results["fitted"], results["package"]
    names = ("t_kernel (µs)", "t_view (µs)", "rate (G madds/s)", "bandwidth (GB/s)")

    def shown(c: dict) -> list[str]:
        return [
            f"{c['seconds_per_kernel'] * 1e6:.2f}",
            f"{c['seconds_per_view'] * 1e6:.2f}",
            f"{c['madds_per_second'] / 1e9:.3g}" if c["madds_per_second"] else "∞",
            f"{c['bytes_per_second'] / 1e9:.3g}" if c["bytes_per_second"] else "∞",
        ]

    lines = [
        "# The cost model of `ntk`'s route choice",
        "",
        f"Generated by `{results['command']}` on {results['date']}: torch "
        f"{results['torch']}, {results['threads']} threads, device "
        f"{results['device']}, float32; medians of {results['rounds']} interleaved "
        "rounds. Each route's step is `ntk(x, x)` and the gradient of `Σ K²`;"
        " `factors` is `structured=True`, `jacobians` `structured=False`.",
        "",
        "| constants | " + " | ".join(names) + " |",
        "|---|---|---|---|---|",
        "| fitted here | " + " | ".join(shown(fitted)) + " |",
        "| the package's (`device_costs`) | " + " | ".join(shown(package)) + " |",
        "",
        "| case | B | factors (ms) | jacobians (ms) | kernels f/j | views f/j "
        "| difference measured (ms) | predicted, fitted | predicted, package "
        "| the package took | the faster |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    right, regret = 0, 1.0
    for row in results["rows"]:
        f, j = row["factors"], row["jacobians"]
        measured = f["seconds"] - j["seconds"]
        choice = row.get("took") or (
            "factors" if row["package_prediction"] <= 0 else "jacobians"
        )
        faster = "factors" if measured <= 0 else "jacobians"
        right += choice == faster
        regret = max(regret, row[choice]["seconds"] / min(f["seconds"], j["seconds"]))
        lines.append(
            f"| {row['case']} | {row['batch']} | {f['seconds'] * 1e3:.2f} | "
            f"{j['seconds'] * 1e3:.2f} | {f['kernels']}/{j['kernels']} | "
            f"{f['views']}/{j['views']} | {measured * 1e3:+.2f} | "
            f"{row['fitted_prediction'] * 1e3:+.2f} | "
            f"{row['package_prediction'] * 1e3:+.2f} | {choice} | {faster} |"
        )
    lines += [
        "",
        f"`ntk`'s default took the faster route on {right} of "
        f"{len(results['rows'])} cases; at worst its route takes {regret:.2f}× the "
        "faster route's time.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke sizes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the report here")
    parser.add_argument("--report-from", help="render the report of this JSON only")
    args = parser.parse_args(argv)
    if args.report_from:
        with open(args.report_from) as f:
            results = json.load(f)
        with open(args.markdown or "/dev/stdout", "w") as f:
            f.write(render(results))
        return results
    device = torch.device(args.device)
    batches = [1, 4] if args.quick else [1, 2, 4, 8, 16, 32, 64]
    rows = measure(batches, 2 if args.quick else args.rounds, device)
    coefficients = fit(rows)
    fitted = DeviceCosts(
        coefficients[0],
        coefficients[1],
        1 / coefficients[2] if coefficients[2] else float("inf"),
        1 / coefficients[3] if coefficients[3] else float("inf"),
    )
    package = device_costs(device, torch.float32)
    for row in rows:
        row["fitted_prediction"] = _predicted(row, fitted)
        row["package_prediction"] = _predicted(row, package)

    def as_dict(c: DeviceCosts) -> dict:
        return {k: (0.0 if v == float("inf") else v) for k, v in vars(c).items()}

    results = {
        "command": "python benchmarks/jacobians/route_costs.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "rounds": 2 if args.quick else args.rounds,
        "fitted": as_dict(fitted),
        "package": as_dict(package),
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(render(results))
    return results


if __name__ == "__main__":
    main()
