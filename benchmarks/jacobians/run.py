"""Jacobian routes side by side: ``python benchmarks/jacobians/run.py [--quick]``.

Peak memory and correctness: every (configuration, method) pair runs in its own
fresh subprocess (:mod:`worker`), so the peak-memory figures do not see each
other. Speed: a subprocess per configuration times all methods that ran, in
turn, round after round, so that the machine's slow and fast spells fall on all
of them alike; this is repeated in ``--repeats`` separate processes (default 3,
spread over the run) and the medians are combined by their median, so that the
luck of one process's memory layout does not decide a ratio. The Markdown
report (default ``RESULTS.md`` beside this script) and the raw results (``--json``) are
written by :mod:`report`. ``--quick`` runs smoke-size cases in well under a minute;
its timings mean nothing, it checks the harness (``tests/test_benchmarks.py``).

``--allocator default thp mmap-off`` (one or more, :mod:`allocator`) measures
everything once per CPU allocator setting, each process started in that
setting's environment; every result records its setting and the tables have a
row per (configuration, setting). ``--device cuda`` runs the models and inputs on
the GPU (times synchronised, peak memory from the CUDA allocator).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from allocator import ALLOCATORS, process_environment  # noqa: E402
from cases import FULL, GRAM_FULL, GRAM_QUICK, QUICK, Config  # noqa: E402
from methods import DICT_METHODS, JACOBIAN_METHODS  # noqa: E402
from report import write_report  # noqa: E402


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def gram_routes() -> tuple[list[str], list[str]]:
    """Available Gram routes, and notes on the missing ones."""
    routes, notes = ["J"], []
    if _has_module("laplace_diffjac.kernels"):
        routes.append("structured")
    else:
        notes.append("`laplace_diffjac.kernels` absent: no structured column.")
    if _has_module("laplace_diffjac.kernels"):
        routes.append("kernel")
    else:
        notes.append(
            "`laplace_diffjac.kernels.ntk` absent at the time of the run: the "
            "context optimiser's Gram column is skipped."
        )
    return routes, notes


def run_worker(spec: dict, timeout: float) -> list[dict]:
    """Run one spec in a fresh interpreter and parse its ``RESULT`` lines."""
    cmd = [sys.executable, os.path.join(HERE, "worker.py"), json.dumps(spec)]
    env = process_environment(spec.get("allocator", "default"))
    env["PYTHONWARNINGS"] = "ignore"
    # the workers import this checkout's package, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p
    )
    error = None
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env
        )
        got = {}
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT ") :])
                got[res["method"]] = res
        error = f"worker exit {proc.returncode}: {(proc.stderr or '')[-300:]}"
    except subprocess.TimeoutExpired:
        got, error = {}, f"timeout after {timeout:.0f} s"
    name = Config(**spec["config"]).name
    labels = {
        k: spec.get(k, v) for k, v in (("allocator", "default"), ("device", "cpu"))
    }
    return [
        got.get(m)
        or {"config": name, "task": spec["task"], "method": m, "ok": False,
            "error": error, **labels}
        for m in spec["methods"]
    ]  # fmt: skip


def build_specs(
    quick: bool,
    methods: list[str],
    only: list[str] | None = None,
    allocators: tuple[str, ...] | list[str] = ("default",),
    device: str = "cpu",
) -> tuple[list[dict], list[str]]:
    """The memory, correctness and Gram measurements of one run, and report notes.

    The interleaved timing of each Jacobian configuration is made afterwards by
    :func:`timing_spec`, over the methods that ran there. ``only`` restricts
    the run to the named configurations; every measurement is made once per
    allocator setting, on ``device``.
    """
    configs, grams = (QUICK, GRAM_QUICK) if quick else (FULL, GRAM_FULL)
    if only:
        configs = [c for c in configs if c.name in only]
        grams = [(c, j) for c, j in grams if c.name in only]
        unknown = set(only) - {c.name for c in configs} - {c.name for c, _ in grams}
        if unknown:
            raise SystemExit(f"--configs: unknown configuration(s) {sorted(unknown)}")
    routes, notes = gram_routes()
    specs = []
    for cfg in configs:
        usable = methods if cfg.kind != "transformer" else [
            m for m in methods if m in DICT_METHODS
        ]  # fmt: skip
        specs += _specs(cfg, "jacobian", usable, quick)
    for cfg, with_j in grams:
        wanted = [r for r in routes if with_j or r != "J"]
        specs += _specs(cfg, "gram", wanted, quick)
    return [
        {**spec, "allocator": allocator, "device": device}
        for allocator in allocators
        for spec in specs
    ], notes


def _specs(cfg: Config, task: str, methods: list[str], quick: bool) -> list[dict]:
    """One process per method; in quick mode one process per configuration."""
    groups = [methods] if quick else [[m] for m in methods]
    return [
        {"config": cfg.to_dict(), "task": task, "methods": g, "quick": quick}
        for g in groups
    ]


def timing_spec(
    results: list[dict],
    config: dict,
    quick: bool,
    allocator: str = "default",
    device: str = "cpu",
) -> dict | None:
    """Interleaved timing of the methods that ran on ``config`` without failing."""
    name = Config(**config).name
    ran = [
        r["method"]
        for r in results
        if r["task"] == "jacobian"
        and r["config"] == name
        and r.get("allocator", "default") == allocator
        and r.get("ok")
    ]
    if not ran:
        return None
    return {
        "config": config,
        "task": "timing",
        "methods": ran,
        "quick": quick,
        "allocator": allocator,
        "device": device,
    }


def merge_timings(results: list[dict], timings: list[dict]) -> None:
    """Put the timings into the (configuration, method) results they belong to.

    With several timing processes per configuration, each time is the median over
    the processes of their medians; the per-process values are kept as well.
    """
    index = {_key(r): r for r in results if r["task"] == "jacobian"}
    grouped: dict[tuple[str, str, str], list[dict]] = {}
    for t in timings:
        grouped.setdefault(_key(t), []).append(t)
    for key, runs in grouped.items():
        res = index.get(key)
        if res is None:
            continue
        failed = [t for t in runs if not t.get("ok")]
        if failed:
            res.update(ok=False, error=f"timing: {failed[0].get('error')}")
            continue
        for name in ("t_jac", "t_full", "t_obj"):
            values = [t[name] for t in runs]
            res[name] = statistics.median(values)
            res[f"{name}_per_process"] = values
        res["reps"] = sum(t["reps"] for t in runs)
        res["timing_processes"] = len(runs)


def _key(res: dict) -> tuple[str, str, str]:
    """A result's (configuration, allocator setting, method)."""
    return res["config"], res.get("allocator", "default"), res["method"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-size run")
    parser.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    parser.add_argument("--json", default=None, help="also write raw results here")
    parser.add_argument("--methods", nargs="*", default=list(JACOBIAN_METHODS))
    parser.add_argument("--timeout", type=float, default=150.0, help="per worker, s")
    parser.add_argument(
        "--configs",
        nargs="*",
        default=None,
        help="only these configurations, by name (e.g. mlp2x64-C1-B32)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="workers at once (default 1; 2 with --quick, where timings are moot)",
    )
    parser.add_argument(
        "--timing-jobs",
        type=int,
        default=None,
        help="timing workers at once (default: as --jobs; 1 keeps them apart)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timing processes per configuration (1 with --quick)",
    )
    parser.add_argument(
        "--allocator",
        nargs="+",
        choices=ALLOCATORS,
        default=["default"],
        help="CPU allocator setting(s); each measured in processes of its own",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument(
        "--report-from",
        default=None,
        help="render the report again from a --json file of an earlier run",
    )
    args = parser.parse_args(argv)
    if args.report_from:
        return rerender(args.report_from, args.out)
    jobs = args.jobs or (2 if args.quick else 1)
    specs, notes = build_specs(
        args.quick, args.methods, args.configs, args.allocator, args.device
    )
    start = time.perf_counter()
    results: list[dict] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for batch in pool.map(lambda s: run_worker(s, args.timeout), specs):
            _log(batch)
            results += batch
    with ThreadPoolExecutor(max_workers=args.timing_jobs or jobs) as pool:
        pairs = [
            (s["config"], s["allocator"]) for s in specs if s["task"] == "jacobian"
        ]
        unique = [c for i, c in enumerate(pairs) if c not in pairs[:i]]
        repeats = 1 if args.quick else args.repeats
        timing = [
            t
            for _ in range(repeats)
            for c, allocator in unique
            if (t := timing_spec(results, c, args.quick, allocator, args.device))
        ]
        timeout = args.timeout * (1 if args.quick else 6)
        timings: list[dict] = []
        for batch in pool.map(lambda s: run_worker(s, timeout), timing):
            _log(batch)
            timings += batch
    merge_timings(results, timings)
    elapsed = time.perf_counter() - start
    write_report(results, args.out, quick=args.quick, notes=notes, wall_s=elapsed)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    print(f"wrote {args.out} ({elapsed:.0f} s)")
    return results


def rerender(raw: str, out: str) -> list[dict]:
    """Write the report of saved results (e.g. after a change to the report)."""
    with open(raw) as fh:
        results = json.load(fh)
    quick = any(r.get("quick", False) for r in results)
    when = datetime.datetime.fromtimestamp(os.path.getmtime(raw))
    write_report(results, out, quick=quick, notes=[], wall_s=None, when=when)
    print(f"wrote {out}")
    return results


def _log(batch: list[dict]) -> None:
    for res in batch:
        status = "ok" if res.get("ok") else f"FAILED ({res.get('error')})"
        print(
            f"{res['config']:>24} {res.get('allocator', 'default'):>8} "
            f"{res['task']:>8} {res['method']:>16} {status}",
            flush=True,
        )


if __name__ == "__main__":
    main()
