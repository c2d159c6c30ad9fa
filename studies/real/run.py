"""Command line of the real-data study: ``python -m studies.real`` (or this file).

``--quick`` runs tiny sizes (two small data sets, one seed, few steps) in well
under a minute; the defaults are the full study (see ``README.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``studies.real`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "studies.real"

from .data import DATASETS  # noqa: E402
from .evaluate import StudyConfig  # noqa: E402
from .methods import METHODS  # noqa: E402
from .training import TrainConfig  # noqa: E402

SEEDS = (68, 117, 36, 187, 17)
FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20)
QUICK = {
    "datasets": ["wine", "diabetes"],
    "seeds": [68],
    "fractions": [0.05, 0.2],
    "steps": 5,
    "valla_iterations": 5,
    "epochs": 200,
    "width": 8,
    "grid": [0.1, 1.0, 10.0],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``--help`` lists the options)."""
    return build_parser(__doc__).parse_args(argv)


def build_parser(description: str | None) -> argparse.ArgumentParser:
    """The study's options (shared with the parts' command, ``uncertainty.py``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes, < 1 minute")
    p.add_argument("--datasets", nargs="+", choices=sorted(DATASETS))
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--fractions", nargs="+", type=float, help="M as shares of N")
    p.add_argument("--methods", nargs="+", choices=list(METHODS))
    p.add_argument("--steps", type=int, help="optimize_locations steps")
    p.add_argument(
        "--batch-size", type=int, default=StudyConfig.batch_size, help="optimiser batch"
    )
    p.add_argument("--valla-iterations", type=int)
    p.add_argument("--epochs", type=int, help="MAP training epochs (max)")
    p.add_argument("--width", type=int, help="hidden units per layer (default 50)")
    p.add_argument("--workers", type=int, default=2, help="processes")
    p.add_argument("--resume", action="store_true", help="reuse finished tasks")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="only rewrite the report from OUT/raw (finished and partial tasks)",
    )
    p.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results"
    )
    return p


def configs(
    args: argparse.Namespace, defaults: dict | None = None, part: str = "main"
) -> tuple[list, list, StudyConfig, TrainConfig]:
    """Data sets, seeds, study and training settings from the arguments.

    ``defaults`` replaces the study's defaults (data sets, seeds, fractions) and
    ``--quick``'s settings (key ``quick``) for a part of the study.
    """
    defaults = defaults or {}
    quick = defaults.get("quick", QUICK) if args.quick else {}
    datasets = args.datasets or quick.get(
        "datasets", defaults.get("datasets", list(DATASETS))
    )
    seeds = args.seeds or quick.get("seeds", defaults.get("seeds", list(SEEDS)))
    base = StudyConfig()
    fractions = defaults.get("fractions", FRACTIONS)
    study = StudyConfig(
        part=part,
        fractions=tuple(args.fractions or quick.get("fractions", fractions)),
        methods=tuple(args.methods or METHODS),
        steps=args.steps if args.steps is not None else quick.get("steps", base.steps),
        batch_size=args.batch_size,
        valla_iterations=args.valla_iterations
        or quick.get("valla_iterations", base.valla_iterations),
        grid=tuple(quick.get("grid", base.grid)),
    )
    train = TrainConfig(
        epochs=args.epochs or quick.get("epochs", 300),
        width=args.width or quick.get("width", 50),
    )
    return datasets, seeds, study, train


def main(argv: list[str] | None = None) -> None:
    """Run the study and write the report into ``--out``."""
    from .report import write_report

    args = parse_args(argv)
    execute(args, configs(args), "python -m studies.real", write_report, argv)


def execute(args, settings, program: str, write, argv: list[str] | None) -> None:
    """Run (or ``--report-only`` reload) the tasks, then ``write`` the report."""
    from .runner import load_records, run_study

    datasets, seeds, study, train = settings
    args.out.mkdir(parents=True, exist_ok=True)
    command = program + " " + " ".join(sys.argv[1:] if argv is None else argv)
    run_file = args.out / "run.json"
    if args.report_only:
        tasks = [(d, s) for d in datasets for s in seeds]
        records = load_records(args.out / "raw", tasks)
        run = json.loads(run_file.read_text()) if run_file.exists() else {}
    else:
        started, start = time.strftime("%Y-%m-%d %H:%M:%S"), time.perf_counter()
        records = run_study(
            datasets, seeds, study, train, args.out, args.workers, args.resume
        )
        run = {
            "command": command.strip(),
            "started": started,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall_s": time.perf_counter() - start,
            "workers": args.workers,
            "cpu_count": os.cpu_count(),
            "load_average_at_end": list(os.getloadavg()),
        }
        run_file.write_text(json.dumps(run, indent=1))
    write(records, args.out, run.get("command", command.strip()), run)
    print(f"wrote {args.out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
