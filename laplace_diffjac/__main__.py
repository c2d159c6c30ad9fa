"""``python -m laplace_diffjac``: random versus optimised context locations."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="laplace-diffjac",
        description=(
            "Train a small MLP, fit the full-data GGN Laplace as reference, choose M "
            "context locations at random or by optimising the likelihood-weighted "
            "Nyström gap through the NTK, and compare FunctionalLaplace and the "
            "context-point (DTC) posterior on both."
        ),
    )
    parser.add_argument(
        "--task", choices=("regression", "classification"), default="regression"
    )
    parser.add_argument("--m", type=int, default=None, help="number of locations")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out-dir",
        default="demo_output",
        help="folder for the plot, created if missing (default demo_output)",
    )
    parser.add_argument(
        "--output", default=None, help="PNG path (default OUT_DIR/<task>.png)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes")
    parser.add_argument(
        "--no-progress", action="store_true", help="hide the progress bar"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the exit status.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        0 on success.

    """
    args = _parser().parse_args(argv)
    from .examples import format_table, run_demo
    from .examples.plotting import plot

    start = time.perf_counter()
    result = run_demo(
        task=args.task,
        m=args.m,
        steps=args.steps,
        seed=args.seed,
        quick=args.quick,
        progress_bar=not args.no_progress,
    )
    s = result.settings
    print(f"task={s.task}  N={s.n}  M={s.m}  seed={args.seed}")
    print(format_table(result))
    path = Path(args.output or Path(args.out_dir) / f"{args.task}.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(result, str(path))
    print(f"plot written to {path}")
    print(f"total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
