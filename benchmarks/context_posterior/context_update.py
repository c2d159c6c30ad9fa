"""Time ``ContextPosterior.update`` (new data folded in) against a refit on the union.

Writes a Markdown table. Usage::

    python benchmarks/context_posterior/context_update.py [--quick] [--out FILE.md]

(default ``--out``: ``CONTEXT_UPDATE.md`` beside this script)

Setting: a 2-50-50-C tanh MLP, ``N`` old points, ``b`` new ones, ``M`` locations;
median of ``--repeats`` runs, single process. ``update`` touches only the ``b`` new
points (``O(b (MC)²)``); a refit passes over all ``N + b``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from laplace_diffjac.context import ContextPosterior

HERE = Path(__file__).resolve().parent


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(N: int, b: int, M: int, C: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, C)
    ).double()
    x, x_new = torch.randn(N, 2).double(), torch.randn(b, 2).double()
    y, y_new = torch.randn(N, C).double(), torch.randn(b, C).double()
    z = x[:M]
    base = ContextPosterior(model, "regression", z).fit((x, y))
    state = base.state_dict()

    def loaded():
        la = ContextPosterior(model, "regression", z)
        la.load_state_dict(state)
        return la

    def refit():
        ContextPosterior(model, "regression", z).fit(
            (torch.cat([x, x_new]), torch.cat([y, y_new]))
        )

    copies = iter([loaded() for _ in range(repeats)])  # untimed set-up
    t_up = _time(lambda: next(copies).update(x_new, y_new), repeats)
    t_re = _time(refit, repeats)
    return {"N": N, "b": b, "M": M, "C": C, "update": t_up, "refit": t_re}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "CONTEXT_UPDATE.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    configs = [(2000, 50, 20, 1), (2000, 50, 50, 3)]
    if not args.quick:
        configs += [(10000, 100, 100, 1), (10000, 100, 50, 3)]
    lines = [
        "| N | b | M | C | update (s) | refit (s) | refit / update |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for N, b, M, C in configs:
        r = _row(N, b, M, C, 1 if args.quick else args.repeats)
        lines.append(
            f"| {N} | {b} | {M} | {C} | {r['update']:.4f} | {r['refit']:.4f} | "
            f"{r['refit'] / r['update']:.1f} |"
        )
    text = "\n".join(
        [
            "# ContextPosterior.update vs refit",
            "",
            *lines,
            "",
            "Median of repeats, one thread, float64, CPU.",
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
