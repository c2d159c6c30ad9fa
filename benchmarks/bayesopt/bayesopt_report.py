"""Report of ``bayesopt.py``: tables, the criterion check, regret curves."""

from __future__ import annotations

import json
import math
import pathlib
import statistics
from collections import defaultdict
from typing import Any

REFERENCE = "LaplaceBoTorch"
#: The headline table's methods: the two references and the package's defaults.
HEADLINE = ("SingleTaskGP", "LaplaceBoTorch", "ContextBoTorch")


def load(out: pathlib.Path) -> list[dict]:
    """Every finished task's record under ``out/raw``."""
    return [json.loads(p.read_text()) for p in sorted((out / "raw").glob("*.json"))]


def _mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, statistics.stdev(values) / math.sqrt(len(values))


#: The smallest regret the log10 columns take (a regret of 0 found the optimum).
REGRET_FLOOR = 1e-12


def _log10_regret(regret: float) -> float:
    return math.log10(max(regret, REGRET_FLOOR))


def paired_log10_difference(ours: dict, ref: dict) -> tuple[float, float, int]:
    """Mean ± standard error of log10 final regret minus the reference's.

    Over the seeds both ran: every method starts from the seed's initial design,
    so the per-seed difference removes the design's luck.

    Returns
    -------
    tuple
        Mean, standard error (NaN for one seed) and the number of seeds.
    """
    a, b = ours["final_log10_regret_by_seed"], ref["final_log10_regret_by_seed"]
    diffs = [a[seed] - b[seed] for seed in a if seed in b]
    if not diffs:
        return math.nan, math.nan, 0
    mean, se = _mean_se(diffs)
    return mean, se, len(diffs)


#: Iterations counted as "early" in the improving-iterations table: the updates
#: before ``ContextBoTorch``'s first retraining (it retrains every 10 updates).
EARLY_ITERATIONS = 10


def _improving_shares(records: list[dict]) -> dict[str, float | None]:
    """Share of the iterations that lowered the regret, early and after.

    Iterations ``1..EARLY_ITERATIONS`` and the rest, pooled over seeds (None
    where the runs have none).
    """
    early, late = [], []
    for r in records:
        steps = [b < a for a, b in zip(r["regret"], r["regret"][1:])]
        early += steps[:EARLY_ITERATIONS]
        late += steps[EARLY_ITERATIONS:]
    return {
        "improving_early": statistics.fmean(early) if early else None,
        "improving_late": statistics.fmean(late) if late else None,
    }


def aggregate(records: list[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per function and method: final regret, per-iteration seconds, seeds."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[r["function"], r["method"]].append(r)
    table: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (function, method), rs in sorted(groups.items()):
        final = [r["regret"][-1] for r in rs]
        log_final = [_log10_regret(v) for v in final]
        fit = [statistics.fmean(r["fit_s"][1:] or r["fit_s"]) for r in rs]
        acq = [statistics.fmean(r["acq_s"]) for r in rs]
        mean, se = _mean_se(final)
        table[function][method] = {
            "seeds": sorted(r["seed"] for r in rs),
            "final_regret_mean": mean,
            "final_regret_se": se,
            "final_log10_regret_mean": _mean_se(log_final)[0],
            "final_log10_regret_se": _mean_se(log_final)[1],
            "final_log10_regret_by_seed": {
                str(r["seed"]): v for r, v in zip(rs, log_final)
            },
            "initial_fit_s": statistics.fmean(r["fit_s"][0] for r in rs),
            "fit_s_per_iteration": statistics.fmean(fit),
            "acq_s_per_iteration": statistics.fmean(acq),
            "s_per_iteration": statistics.fmean(fit) + statistics.fmean(acq),
            "curve_mean": [
                statistics.fmean(c) for c in zip(*(r["regret"] for r in rs))
            ],
            "curve_se": [_mean_se(list(c))[1] for c in zip(*(r["regret"] for r in rs))],
            "seconds_mean": [
                statistics.fmean(c) for c in zip(*(_elapsed(r) for r in rs))
            ],
            **_improving_shares(rs),
            "warnings": sorted({w for r in rs for w in r.get("warnings", [])}),
            **_posterior_calls(rs),
        }
    return table


def _posterior_calls(records: list[dict]) -> dict[str, float]:
    """Posterior calls per acquisition, and process milliseconds per call.

    The milliseconds are the acquisition's seconds over its calls: the call,
    its gradient and BoTorch's work on its output. Empty for records written
    before the counts were kept (``acq_calls``).
    """
    if not records or not all("acq_calls" in r for r in records):
        return {}
    per_acquisition = [c for r in records for c in r["acq_calls"]]
    calls = sum(c["calls"] for c in per_acquisition)
    points = sum(c["points"] for c in per_acquisition)
    seconds = sum(s for r in records for s in r["acq_s"])
    counts = {
        "posterior_calls_per_acquisition": calls / len(per_acquisition),
        "points_per_posterior_call": points / calls,
        "ms_per_posterior_call": 1e3 * seconds / calls,
    }
    if all("acq_on_faces" in r for r in records):  # kept since 2026-12-03
        shares = [s for r in records for s in r["acq_on_faces"]]
        counts["on_faces_share"] = sum(shares) / len(shares)
    return counts


def _elapsed(record: dict) -> list[float]:
    """Process seconds spent when each regret of ``record`` was reached.

    The initial fit, then per iteration its acquisition and the fit or update on
    its observations (``regret[i]`` is known after ``i`` iterations).
    """
    total, elapsed = record["fit_s"][0], [record["fit_s"][0]]
    for acq, fit in zip(record["acq_s"], record["fit_s"][1:]):
        total += acq + fit
        elapsed.append(total)
    return elapsed


def criterion(table: dict) -> list[dict]:
    """Each ContextBoTorch variant against LaplaceBoTorch (the issue's criterion)."""
    rows = []
    methods = sorted(
        {m for per in table.values() for m in per if m.startswith("Context")}
    )
    for method in methods:
        cells = []
        for function, per in table.items():
            if method not in per or REFERENCE not in per:
                continue
            ours, ref = per[method], per[REFERENCE]
            cells.append(
                {
                    "function": function,
                    "regret_no_worse": _no_worse(ours, ref),
                    "time_ratio": ours["s_per_iteration"] / ref["s_per_iteration"],
                }
            )
        no_worse = sum(c["regret_no_worse"] for c in cells)
        fast = all(c["time_ratio"] <= 0.2 for c in cells)
        rows.append(
            {
                "method": method,
                "cells": cells,
                "no_worse_on": no_worse,
                "functions": len(cells),
                "met": bool(cells) and no_worse == len(cells) and fast,
            }
        )
    return rows


def _no_worse(ours: dict, ref: dict) -> bool:
    """Mean final regret at most the reference's plus one standard error.

    The standard error is the larger of the two (a single seed has none: then
    the means are compared).
    """
    errors = (ours["final_regret_se"], ref["final_regret_se"])
    se = max((e for e in errors if not math.isnan(e)), default=0.0)
    return ours["final_regret_mean"] <= ref["final_regret_mean"] + se


def headline(table: dict) -> list[str]:
    """Markdown lines: final regret of ``HEADLINE``'s methods per function.

    Each cell is the mean ± standard error (seeds) and, for the neural
    surrogates, the time per iteration relative to ``LaplaceBoTorch``; the best
    mean per function is bold.
    """
    lines = [
        "## Headline",
        "",
        "Final simple regret, mean ± standard error (seeds); time per iteration "
        "relative to LaplaceBoTorch's; bold: the lowest mean.",
        "",
        "| function | " + " | ".join(HEADLINE) + " |",
        "|---|" + "---|" * len(HEADLINE),
    ]
    for function, per in table.items():
        present = [m for m in HEADLINE if m in per]
        if not present:
            continue
        best = min(per[m]["final_regret_mean"] for m in present)
        ref = per.get(REFERENCE)
        cells = []
        for method in HEADLINE:
            if method not in per:
                cells.append("–")
                continue
            a = per[method]
            mean = _fmt(a["final_regret_mean"])
            text = f"**{mean}**" if a["final_regret_mean"] == best else mean
            text += f" ± {_fmt(a['final_regret_se'])} ({len(a['seeds'])})"
            if ref is not None and method != "SingleTaskGP":
                ratio = a["s_per_iteration"] / ref["s_per_iteration"]
                text += f", {ratio:.2f}× time"
            cells.append(text)
        lines.append(f"| {function} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "–"
    return f"{x:.3g}"


def markdown(table: dict, rows: list[dict], run: dict) -> str:
    """The Markdown report."""
    lines = ["# Bayesian optimisation", ""]
    for r in run.get("runs", []):
        lines.append(
            f"* `{r['command']}`: started {r['start']} UTC, {r['tasks_run']} tasks, "
            f"{r['wall_s'] / 60:.1f} min wall, {r['workers']} worker process(es) of "
            "one thread" + (f" ({r['note']})" if r.get("note") else "")
        )
    lines += ["", "Settings: `run.json` and `benchmarks/bayesopt/bayesopt.py`.", ""]
    lines += headline(table)
    lines += [
        "Simple regret after the last iteration (optimum minus the best value "
        "observed), mean ± standard error over seeds; seconds per iteration are "
        "process CPU seconds, the mean over iterations: the surrogate's fit or "
        "update, and the acquisition's optimisation. log10: of the final regret "
        f"(floored at {REGRET_FLOOR:g}), mean ± standard error; paired: its "
        "difference from LaplaceBoTorch's on the same seeds (the same initial "
        "designs), mean ± standard error (negative: lower regret).",
        "",
        "| function | method | seeds | final regret | log10 | paired log10 − "
        "LaplaceBoTorch | fit/update s | acquisition s | s per iteration "
        "| × LaplaceBoTorch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for function, per in table.items():
        ref = per.get(REFERENCE)
        for method, a in per.items():
            ratio = a["s_per_iteration"] / ref["s_per_iteration"] if ref else math.nan
            paired = "–"
            if ref is not None and method != REFERENCE:
                mean, se, n = paired_log10_difference(a, ref)
                paired = f"{mean:+.2f} ± {se:.2f} ({n})" if n else "–"
            lines.append(
                f"| {function} | {method} | {len(a['seeds'])} | "
                f"{_fmt(a['final_regret_mean'])} ± {_fmt(a['final_regret_se'])} | "
                f"{a['final_log10_regret_mean']:.2f} ± "
                f"{a['final_log10_regret_se']:.2f} | {paired} | "
                f"{_fmt(a['fit_s_per_iteration'])} | {_fmt(a['acq_s_per_iteration'])} "
                f"| {_fmt(a['s_per_iteration'])} | {_fmt(ratio)} |"
            )
    lines += _acquisition_lines(table)
    lines += [
        "",
        "## Improving iterations",
        "",
        "Share of the iterations whose observation lowered the simple regret, "
        f"pooled over seeds: iterations 1–{EARLY_ITERATIONS} (before "
        "ContextBoTorch's first retraining) and after.",
        "",
        f"| function | method | 1–{EARLY_ITERATIONS} | after |",
        "|---|---|---|---|",
    ]
    for function, per in table.items():
        for method, a in per.items():
            lines.append(
                f"| {function} | {method} | {_percent(a['improving_early'])} | "
                f"{_percent(a['improving_late'])} |"
            )
    lines += ["", "## Criterion", "",
              "ContextBoTorch's mean final regret no worse than LaplaceBoTorch's "
              "within one standard error (the larger of the two) on every function, "
              "at a fifth or less of its time per iteration:", ""]  # fmt: skip
    for row in rows:
        cells = ", ".join(
            f"{c['function']}: {'no worse' if c['regret_no_worse'] else 'worse'}, "
            f"{c['time_ratio']:.2f}× time"
            for c in row["cells"]
        )
        verdict = "**met**" if row["met"] else "**not met**"
        lines.append(f"* {row['method']}: {verdict} ({cells})")
    warned = {(f, m): a["warnings"] for f, per in table.items() for m, a in per.items()}
    notes = sorted({w for ws in warned.values() for w in ws})
    if notes:
        lines += ["", "## Warnings raised during the runs", ""]
        lines += [f"* {w[:200]}" for w in notes]
    lines += ["", "![simple regret](regret.png)", ""]
    return "\n".join(lines)


def _acquisition_lines(table: dict) -> list[str]:
    """Markdown lines: posterior calls per acquisition and the cost of each.

    Only the methods whose records kept the counts; none: no lines. The share
    of the chosen points' coordinates on the cube's faces: "–" where the records
    predate it.
    """
    rows = [
        f"| {method} | {function} | {a['posterior_calls_per_acquisition']:.0f} | "
        f"{a['points_per_posterior_call']:.0f} | {a['ms_per_posterior_call']:.3g} | "
        f"{_percent(a.get('on_faces_share'))} |"
        for function, per in table.items()
        for method, a in per.items()
        if "ms_per_posterior_call" in a
    ]
    if not rows:
        return []
    return [
        "",
        "## Acquisition",
        "",
        "The acquisition's seconds split into how often the optimiser called the "
        "surrogate's posterior (raw-sample scoring and every L-BFGS-B evaluation) "
        "and the process milliseconds per call (the call, its gradient and "
        "BoTorch's work on it), the means over all acquisitions; and the share of "
        "the chosen points' coordinates on the cube's faces (a surrogate that "
        "extrapolates upwards sends them to the corners, where the optimiser has "
        "few coordinates left to move).",
        "",
        "| method | function | posterior calls | points per call | ms per call "
        "| coordinates on faces |",
        "|---|---|---|---|---|---|",
        *rows,
    ]


def _percent(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.0f} %"


def plot(table: dict, out: pathlib.Path) -> None:
    """``regret.png`` (all functions), ``regret_headline.png`` (all functions,
    ``HEADLINE``'s methods), ``regret_<function>.png`` and ``regret_time.png``
    (against the seconds spent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    functions = list(table)
    fig, axes = plt.subplots(1, len(functions), figsize=(5 * len(functions), 4))
    axes = [axes] if len(functions) == 1 else list(axes)
    for ax, function in zip(axes, functions):
        _panel(ax, function, table[function])
        single, single_ax = plt.subplots(figsize=(5.5, 4))
        _panel(single_ax, function, table[function])
        single_ax.legend(fontsize=7)
        single.tight_layout()
        single.savefig(out / f"regret_{function}.png", dpi=110)
        plt.close(single)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "regret.png", dpi=110)
    plt.close(fig)
    # The headline methods only, every function: the figure the docs show.
    cols = min(4, len(functions))
    rows = math.ceil(len(functions) / cols)
    fig, grid = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False
    )
    axes = list(grid.flat)
    for ax, function in zip(axes, functions):
        per = {m: a for m, a in table[function].items() if m in HEADLINE}
        _panel(ax, function, per)
    for ax in axes[len(functions) :]:
        ax.axis("off")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "regret_headline.png", dpi=110)
    plt.close(fig)
    # Regret against the seconds spent, every method: what a user waits for.
    fig, axes = plt.subplots(1, len(functions), figsize=(5 * len(functions), 4))
    axes = [axes] if len(functions) == 1 else list(axes)
    for ax, function in zip(axes, functions):
        _panel(ax, function, table[function], against_time=True)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "regret_time.png", dpi=110)
    plt.close(fig)


def _panel(ax, function: str, per: dict, against_time: bool = False) -> None:
    for method, a in per.items():
        mean = [max(m, 1e-12) for m in a["curve_mean"]]
        se = [0.0 if math.isnan(s) else s for s in a["curve_se"]]
        steps = a["seconds_mean"] if against_time else range(len(mean))
        ax.plot(steps, mean, label=f"{method} ({len(a['seeds'])})")
        lower = [max(m - s, 1e-12) for m, s in zip(mean, se)]
        ax.fill_between(steps, lower, [m + s for m, s in zip(mean, se)], alpha=0.15)
    ax.set_yscale("log")
    ax.set_title(function)
    if against_time:
        ax.set_xscale("log")
        ax.set_xlabel("process seconds, mean over seeds (initial fit included)")
    else:
        ax.set_xlabel("iteration (0 = initial design)")
    ax.set_ylabel("simple regret (mean ± s.e.)")


def write_report(out: pathlib.Path, cfg: Any) -> None:
    """Write ``BAYESOPT.md``, ``bayesopt.json`` and the PNGs into ``out``."""
    records = load(out)
    table = aggregate(records)
    rows = criterion(table)
    run_path = out / "run.json"
    run = json.loads(run_path.read_text()) if run_path.exists() else {}
    (out / "BAYESOPT.md").write_text(markdown(table, rows, run))
    (out / "bayesopt.json").write_text(
        json.dumps({"table": table, "criterion": rows, "run": run}, indent=1)
    )
    plot(table, out)
