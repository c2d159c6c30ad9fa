"""Issue #44's report: ContextBoTorch against LaplaceBoTorch, tuning half and held out.

The functions are split in ``bayesopt.py`` (``TUNING_FUNCTIONS``, on which the
defaults are chosen, and ``HELD_OUT_FUNCTIONS``, named before any run of theirs).
This script reads the raw records of ``bayesopt.py`` runs made with the issue's
protocol (``--outcomes caller --initial 8 --raw-samples 64``, 24 evaluations
after the design, 10 seeds) and writes, per half and per batch size ``q``, one
table: per function its dimension, both methods' final log10 regret (mean ±
standard error), their paired difference on the same initial designs, the
loop's time ratio (process CPU seconds of the whole run), the share of
iterations that lowered the regret and the share of candidate coordinates on
the cube's faces, and whether the issue's criterion holds (ContextBoTorch's mean
log10 regret at most LaplaceBoTorch's + 0.05, its loop at most 0.2 of the time,
both shares no worse). A function with no records of both methods is listed as
not run. The header names every folder whose runs changed a surrogate setting
of ``bayesopt.py`` (``--retrain-every 1``, say), read from its ``run.json``.

Usage::

    python benchmarks/bayesopt/halves.py --q1 DIR [DIR ...] --q4 DIR [DIR ...] \\
        --out benchmarks/bayesopt/HALVES.md [--ours METHOD]

writes ``HALVES.md`` and ``halves.json`` beside it (``OUT.md``: ``out.json``,
lower case). ``--ours`` compares another method of ``bayesopt.py`` (an ablation
such as ``'ContextBoTorch(kron-covariance)'``) with LaplaceBoTorch instead;
``--laplace DIR [DIR ...]`` takes LaplaceBoTorch's records from those folders
only (for a rerun of ``ours`` alone against the recorded reference).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bayesopt  # noqa: E402  (its folder, above)
from bayesopt_report import (  # noqa: E402
    REFERENCE,
    _log10_regret,
    _mean_se,
    load,
    paired_log10_difference,
)

OURS = "ContextBoTorch"
#: The issue's margin on the mean final log10 regret, and its time ratio.
LOG10_MARGIN = 0.05
TIME_RATIO = 0.2


def function_row(records: list[dict]) -> dict:
    """One method's numbers on one function, from its records (one per seed).

    Parameters
    ----------
    records : list of dict
        ``bayesopt.py``'s raw records of one function and method.

    Returns
    -------
    dict
        ``seeds``, ``log10`` and ``log10_se`` (final regret), ``by_seed``,
        ``cpu_s`` (mean whole-run process seconds), ``improving`` (share of
        iterations that lowered the regret) and ``on_faces`` (share of candidate
        coordinates on the faces; ``None`` where the records lack it).

    """
    finals = [_log10_regret(r["regret"][-1]) for r in records]
    steps = [b < a for r in records for a, b in zip(r["regret"], r["regret"][1:])]
    faces = [s for r in records for s in r.get("acq_on_faces", [])]
    mean, se = _mean_se(finals)
    return {
        "seeds": sorted(r["seed"] for r in records),
        "log10": mean,
        "log10_se": se,
        "final_log10_regret_by_seed": {
            str(r["seed"]): v for r, v in zip(records, finals)
        },
        "cpu_s": statistics.fmean(r["cpu_s"] for r in records),
        "improving": statistics.fmean(steps) if steps else None,
        "on_faces": statistics.fmean(faces) if faces else None,
    }


def compare(
    records: list[dict], functions: tuple[str, ...], ours: str = OURS
) -> list[dict]:
    """``ours`` (ContextBoTorch) against LaplaceBoTorch on each of ``functions``.

    Parameters
    ----------
    records : list of dict
        Raw records (any functions and methods; others are ignored).
    functions : tuple of str
        The half, in order.
    ours : str, default='ContextBoTorch'
        The method compared (an ablation of ``bayesopt.py``'s, say).

    Returns
    -------
    list of dict
        Per function: ``function``, ``dim``, and where both methods ran,
        ``ours`` and ``ref`` (:func:`function_row`), ``paired`` (mean, standard
        error, seeds), ``time_ratio`` and ``met`` (the issue's criterion).

    """
    rows = []
    for function in functions:
        row: dict = {"function": function, "dim": bayesopt.problem_dim(function)}
        mine = [r for r in records if r["function"] == function]
        own = [r for r in mine if r["method"] == ours]
        ref = [r for r in mine if r["method"] == REFERENCE]
        if own and ref:
            a, b = function_row(own), function_row(ref)
            row.update(ours=a, ref=b, paired=paired_log10_difference(a, b))
            row["time_ratio"] = a["cpu_s"] / b["cpu_s"]
            row["met"] = (
                a["log10"] <= b["log10"] + LOG10_MARGIN
                and row["time_ratio"] <= TIME_RATIO
                and _no_worse(a["improving"], b["improving"], higher=True)
                and _no_worse(a["on_faces"], b["on_faces"], higher=False)
            )
        rows.append(row)
    return rows


def _no_worse(ours: float | None, ref: float | None, higher: bool) -> bool:
    if ours is None or ref is None:
        return False
    return ours >= ref if higher else ours <= ref


def _share(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f} %"


def table_lines(title: str, rows: list[dict], ours: str = OURS) -> list[str]:
    """One half at one ``q``: a Markdown table and its count of criteria met."""
    lines = [
        f"### {title}",
        "",
        f"| function | d | {REFERENCE} log10 | {ours} log10 | paired | time "
        "| improving, Laplace / Context | on faces, Laplace / Context | criterion |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    met = ran = 0
    for row in rows:
        if "ours" not in row:
            lines.append(f"| {row['function']} | {row['dim']} | not run |||||||")
            continue
        a, b = row["ours"], row["ref"]
        mean, se, n = row["paired"]
        ran += 1
        met += row["met"]
        lines.append(
            f"| {row['function']} | {row['dim']} | {b['log10']:.2f} ± "
            f"{b['log10_se']:.2f} ({len(b['seeds'])}) | {a['log10']:.2f} ± "
            f"{a['log10_se']:.2f} ({len(a['seeds'])}) | {mean:+.2f} ± {se:.2f} "
            f"({n}) | {row['time_ratio']:.2f}× | {_share(b['improving'])} / "
            f"{_share(a['improving'])} | {_share(b['on_faces'])} / "
            f"{_share(a['on_faces'])} | {'met' if row['met'] else 'not met'} |"
        )
    lines += ["", f"Criterion met on {met} of the {ran} functions run.", ""]
    return lines


#: The surrogates' settings of ``bayesopt.py`` (not the protocol's sizes, which
#: the issue fixes): a folder whose runs changed one is an ablation, and says so.
SURROGATE_SETTINGS = (
    "epochs", "width", "locations", "location_steps", "retrain_every",
    "marglik_iters", "finetune_epochs", "batch_limit", "maxiter",
)  # fmt: skip


def changed_settings(folder: pathlib.Path) -> dict[str, object]:
    """The surrogate settings in which ``folder``'s runs left the defaults.

    Read from the folder's ``run.json`` (every run recorded there); a setting
    that differs between its runs is given as the list of its values.

    Returns
    -------
    dict
        Setting name to its value (``{}``: the defaults, or no ``run.json``).
    """
    path = folder / "run.json"
    if not path.exists():
        return {}
    defaults = dataclasses.asdict(bayesopt.Config())
    configs = [run["config"] for run in json.loads(path.read_text())["runs"]]
    changed: dict[str, object] = {}
    for name in SURROGATE_SETTINGS:
        values = sorted({c[name] for c in configs if name in c})
        if values and values != [defaults[name]]:
            changed[name] = values[0] if len(values) == 1 else values
    return changed


def _settings_sentence(folders: list[pathlib.Path]) -> str:
    """`` Settings other than bayesopt.py's defaults: ...`` or ``""``."""
    parts = []
    for folder in folders:
        changed = changed_settings(folder)
        if changed:
            values = ", ".join(
                f"`--{k.replace('_', '-')} {v}`" for k, v in changed.items()
            )
            parts.append(f"`{folder.name}/` {values}")
    if not parts:
        return ""
    return " Settings other than `bayesopt.py`'s defaults: " + "; ".join(parts) + "."


def report(
    runs: dict[int, list[pathlib.Path]],
    ours: str = OURS,
    laplace: list[pathlib.Path] | None = None,
) -> tuple[str, dict]:
    """``HALVES.md``'s text and its JSON, from the folders of each ``q``.

    Parameters
    ----------
    runs : dict
        ``q`` to the output folders of ``bayesopt.py`` runs at that ``q``.
    ours : str, default='ContextBoTorch'
        The method compared with LaplaceBoTorch.
    laplace : list of pathlib.Path, optional
        Folders whose LaplaceBoTorch records (of every ``q``) are the
        reference; ``runs``' own LaplaceBoTorch records are then ignored (a
        rerun of ``ours`` alone against the recorded reference).

    Returns
    -------
    tuple
        Markdown and the rows behind it.

    """
    halves = {
        "tuning half": bayesopt.TUNING_FUNCTIONS,
        "held-out half": bayesopt.HELD_OUT_FUNCTIONS,
    }
    lines = [
        f"# {ours} against LaplaceBoTorch: tuning half and held-out half",
        "",
        "Generated by `python benchmarks/bayesopt/halves.py"
        + ("" if ours == OURS else f" --ours '{ours}'")
        + "` from the raw records "
        "of: "
        + "; ".join(
            f"q = {q}: " + ", ".join(f"`{p.name}/`" for p in paths)
            for q, paths in runs.items()
        )
        + (
            "; LaplaceBoTorch's from: " + ", ".join(f"`{p.name}/`" for p in laplace)
            if laplace
            else ""
        )
        + ". Final log10 simple regret, mean ± standard error (seeds); paired: "
        f"{ours} minus {REFERENCE} on the same initial designs; time: {ours}'s "
        "whole-run process seconds over LaplaceBoTorch's; improving: the share of "
        "iterations that lowered the regret; on faces: the share of the "
        "candidates' coordinates on the cube's faces. Criterion (issue #44): mean "
        f"log10 at most {REFERENCE}'s + {LOG10_MARGIN}, time at most "
        f"{TIME_RATIO}, both shares no worse."
        + _settings_sentence([p for paths in runs.values() for p in paths]),
        "",
    ]
    data: dict = {}
    for q, paths in runs.items():
        records = [r for p in paths for r in load(p) if r.get("q", 1) == q]
        if laplace:
            records = [r for r in records if r["method"] != REFERENCE]
            records += [
                r
                for p in laplace
                for r in load(p)
                if r["method"] == REFERENCE and r.get("q", 1) == q
            ]
        for name, functions in halves.items():
            rows = compare(records, functions, ours)
            data[f"q{q} {name}"] = rows
            lines += table_lines(f"{name}, q = {q}", rows, ours)
    return "\n".join(lines), data


def main(argv: list[str] | None = None) -> None:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--q1", nargs="+", type=pathlib.Path, default=[])
    parser.add_argument("--q4", nargs="+", type=pathlib.Path, default=[])
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "HALVES.md")
    parser.add_argument(
        "--ours", default=OURS, help="the method against LaplaceBoTorch"
    )
    parser.add_argument(
        "--laplace", nargs="+", type=pathlib.Path, help="LaplaceBoTorch's records from"
    )
    args = parser.parse_args(argv)
    runs = {q: paths for q, paths in ((1, args.q1), (4, args.q4)) if paths}
    text, data = report(runs, args.ours, args.laplace)
    args.out.write_text(text)
    json_name = args.out.stem.lower() + ".json"  # HALVES.md: halves.json
    args.out.with_name(json_name).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
