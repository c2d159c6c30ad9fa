"""Aggregate rows over seeds; write RESULTS.md, results.json and PNG plots."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .criteria import (  # noqa: E402
    COMMON_DELTA_PAIRS,
    check_criteria,
    criteria_markdown,
)
from .data import DATASETS  # noqa: E402
from .published import SFR_DIGITS, SFR_DIGITS_STD, SFR_PROTOCOL_NOTE  # noqa: E402

__all__ = ["aggregate", "write_report"]

METRICS = (
    "delta",
    "nlpd",
    "accuracy",
    "rmse",
    "ece",
    "log_var_error",
    "share_below",
    "fit_s",
    "search_s",
    "predict_s",
    "fit_cpu_s",
    "search_cpu_s",
    "predict_cpu_s",
)


def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var)


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard deviation over seeds per (data set, method, fraction).

    Parameters
    ----------
    rows : list of dict
        Per-seed rows.

    Returns
    -------
    list of dict
        ``{dataset, method, fraction, m, n_seeds, selection, errors,
        <metric>: [mean, std]}``; the standard deviation is the sample one
        (``n − 1``), 0 for a single seed.

    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["dataset"], row["method"], row.get("fraction"))].append(row)
    out = []
    for (ds, method, frac), grp in groups.items():
        ok = [r for r in grp if "error" not in r]
        agg: dict[str, Any] = {
            "dataset": ds,
            "method": method,
            "fraction": frac,
            "m": [r.get("m") for r in grp],
            "n_seeds": len(ok),
            "selection": sorted({r.get("selection", "-") for r in ok}),
            "errors": [r["error"] for r in grp if "error" in r],
        }
        for key in METRICS:
            vals = [r[key] for r in ok if r.get(key) is not None]
            if vals:
                agg[key] = list(_mean_std(vals))
        out.append(agg)
    return out


def _cell(agg: dict, key: str) -> str:
    if key not in agg:
        return "–"
    mean, std = agg[key]
    if key == "delta":  # from 1e-2 to 1e6: significant digits
        return f"{mean:.3g} ± {std:.2g}"
    return f"{mean:.3f} ± {std:.3f}"


def _nlpd_table(ds: str, aggs: list[dict], fractions: list[float]) -> list[str]:
    head = "| method | " + " | ".join(f"M = {f:.0%}" for f in fractions) + " |"
    lines = [head, "|---" * (len(fractions) + 1) + "|"]
    methods = list(dict.fromkeys(a["method"] for a in aggs))
    for method in methods:
        by_f = {a["fraction"]: a for a in aggs if a["method"] == method}
        cells = [_cell(by_f.get(f, by_f.get(None, {})), "nlpd") for f in fractions]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    if ds == "digits":
        for label, values in SFR_DIGITS.items():
            std = SFR_DIGITS_STD[label]
            cells = [
                f"{values[f]:.3f} ± {std[f]:.3f}" if f in values else "–"
                for f in fractions
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _detail_table(aggs: list[dict], task: str) -> list[str]:
    keys = ["nlpd", "accuracy", "ece"] if task == "classification" else ["nlpd", "rmse"]
    keys += ["log_var_error", "share_below", "fit_s", "search_s", "predict_s"]
    keys += ["fit_cpu_s", "search_cpu_s"]
    lines = [
        "| method | M | δ chosen by | δ | " + " | ".join(keys) + " | errors |",
        "|---" * (len(keys) + 5) + "|",
    ]
    order = list(dict.fromkeys(a["method"] for a in aggs))
    aggs = sorted(aggs, key=lambda a: (order.index(a["method"]), a["fraction"] or 0))
    for a in aggs:
        m = sorted({v for v in a["m"] if v is not None})
        ms = "–" if not m else "/".join(map(str, m))
        cells = " | ".join(_cell(a, k) for k in ("delta", *keys))
        sel = ", ".join(a["selection"])
        lines.append(f"| {a['method']} | {ms} | {sel} | {cells} | {len(a['errors'])} |")
    return lines


def _run_line(metas: list[dict]) -> str:
    wall = _mean_std([m["total_s"] for m in metas])[0]
    cpu = [m["cpu_s"] for m in metas if "cpu_s" in m]
    cpu_text = f", {_mean_std(cpu)[0]:.0f} s CPU" if cpu else ""
    return (
        f"N_train = {metas[0]['n_train']}, P = {metas[0]['n_params']}; "
        f"per seed {wall:.0f} s wall{cpu_text} (mean over seeds)."
    )


COMMON_DELTA_ROWS = {name for pair in COMMON_DELTA_PAIRS.values() for name in pair}


def _draw(ax: Any, ds: str, aggs: list[dict], fractions: list[float]) -> None:
    if ds == "digits":  # the published curves at all their M, even in a short run
        fractions = sorted(set(fractions) | set(SFR_DIGITS["SFR (published)"]))
    xs = [100 * f for f in fractions]
    for a_method in dict.fromkeys(a["method"] for a in aggs):
        if a_method in COMMON_DELTA_ROWS:  # tables only: the plot keeps the protocol
            continue
        by_f = {a["fraction"]: a for a in aggs if a["method"] == a_method}
        if None in by_f:  # MAP, FullLaplace: horizontal lines
            if "nlpd" in by_f[None]:
                ax.axhline(
                    by_f[None]["nlpd"][0],
                    ls=":",
                    lw=1,
                    label=a_method,
                    color="k" if a_method == "MAP" else "grey",
                )
            continue
        pts = [
            (100 * f, by_f[f]["nlpd"])
            for f in fractions
            if f in by_f and "nlpd" in by_f[f]
        ]
        if pts:
            ax.errorbar(
                [p[0] for p in pts],
                [p[1][0] for p in pts],
                yerr=[p[1][1] for p in pts],
                marker="o",
                ms=3,
                capsize=2,
                label=a_method,
            )
    if ds == "digits":
        for label, values in SFR_DIGITS.items():
            if label.startswith("MAP"):
                continue
            ax.errorbar(
                xs,
                [values.get(f, math.nan) for f in fractions],
                yerr=[SFR_DIGITS_STD[label].get(f, math.nan) for f in fractions],
                fmt="--x",
                capsize=2,
                color="black" if label.startswith("SFR") else "tab:olive",
                label=label,
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("M (% of N_train)")
    ax.set_ylabel("test NLPD")
    ax.set_title(ds)


def _plot(ds: str, aggs: list[dict], fractions: list[float], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    _draw(ax, ds, aggs, fractions)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_all(aggs: list[dict], path: Path) -> None:
    """One panel per data set, one shared legend."""
    names = list(dict.fromkeys(a["dataset"] for a in aggs))
    cols = min(2, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows + 0.8))
    flat = list(getattr(axes, "flat", [axes]))
    handles: dict[str, Any] = {}
    for ax, ds in zip(flat, names):
        sub = [a for a in aggs if a["dataset"] == ds]
        fractions = sorted({a["fraction"] for a in sub if a["fraction"] is not None})
        _draw(ax, ds, sub, fractions)
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    for ax in flat[len(names) :]:
        ax.set_visible(False)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.12 if rows > 1 else 0.2, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run_text(run: dict[str, Any] | None, records: list[dict]) -> list[str]:
    partial = [
        f"{r['meta']['dataset']} seed {r['meta']['seed']}"
        for r in records
        if r["meta"].get("partial")
    ]
    lines = []
    if run and "wall_s" in run:
        how = "stopped before the end" if run.get("cut_short") else "the whole run"
        lines.append(
            f"Wall time ({how}): {run['wall_s'] / 60:.1f} min "
            f"({run['started']} – {run['finished']}, {run['workers']} worker processes "
            f"of one thread on {run['cpu_count']} cores; load average at the end "
            f"{run['load_average_at_end'][0]:.1f}{run.get('note', '')})."
        )
    cpu = sum(r["meta"].get("cpu_s", 0.0) for r in records)
    if cpu:
        lines.append(f"CPU time of the finished tasks: {cpu / 60:.1f} min.")
    if partial:
        lines.append(f"Tasks cut short (partial rows only): {', '.join(partial)}.")
    return lines + [""] if lines else []


def write_report(
    records: list[dict], out: Path, command: str, run: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write ``RESULTS.md``, ``results.json`` and ``nlpd_<data set>.png``.

    Parameters
    ----------
    records : list of dict
        Per-task ``{"meta", "rows"}`` from :func:`~studies.real.runner.run_study`.
    out : Path
        Output folder.
    command : str
        The command line, recorded in the report.
    run : dict, optional
        Wall time and machine of the run (``run.json``), recorded in the report.

    Returns
    -------
    dict
        What was written to ``results.json``.

    """
    rows = [r for rec in records for r in rec["rows"]]
    aggs = aggregate(rows)
    criteria = check_criteria(aggs)
    result = {
        "command": command,
        "run": run or {},
        "meta": [r["meta"] for r in records],
        "aggregate": aggs,
        "criteria": criteria,
        "rows": rows,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Real-data study",
        "",
        f"Command: `{command}`",
        "",
        "Mean ± standard deviation over seeds. See `studies/real/README.md` "
        "for the protocol.",
        "",
        *_run_text(run, records),
        "![NLPD vs M, every data set](nlpd_vs_m.png)",
        "",
        *criteria_markdown(criteria),
        "",
    ]
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        sub = [a for a in aggs if a["dataset"] == ds]
        task = DATASETS[ds].task
        fractions = sorted({a["fraction"] for a in sub if a["fraction"] is not None})
        seeds = sorted({r["seed"] for r in rows if r["dataset"] == ds})
        lines += [
            f"## {ds} ({task}; seeds {seeds})",
            "",
            f"Source: {DATASETS[ds].source}. Licence: {DATASETS[ds].licence}.",
            "",
            _run_line([r["meta"] for r in records if r["meta"]["dataset"] == ds]),
            "",
            "### Test NLPD",
            "",
        ]
        lines += _nlpd_table(ds, sub, fractions)
        if ds == "digits":
            lines += ["", SFR_PROTOCOL_NOTE]
        lines += ["", "### All metrics", ""]
        lines += _detail_table(sub, task)
        plot = out / f"nlpd_{ds}.png"
        _plot(ds, sub, fractions, plot)
        lines += ["", f"![NLPD vs M, {ds}]({plot.name})", ""]
    _plot_all(aggs, out / "nlpd_vs_m.png")
    (out / "RESULTS.md").write_text("\n".join(lines) + "\n")
    return result
