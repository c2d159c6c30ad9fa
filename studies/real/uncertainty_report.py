"""Report of an uncertainty part: RESULTS.md, results.json and PNG plots.

Rows are aggregated over seeds like the study's (``report.aggregate``); the probe's
metrics (``probes.py``) are aggregated here, keyed ``<set>/<metric>``.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .data import DATASETS  # noqa: E402
from .location_effects import location_effects, location_markdown  # noqa: E402
from .metrics import COVERAGES  # noqa: E402
from .published import OOD_PROTOCOL_NOTE, OOD_PUBLISHED  # noqa: E402
from .report import _mean_std, _run_text, aggregate  # noqa: E402

__all__ = ["aggregate_probes", "write_part_report"]


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, metrics in row.get("probe", {}).items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{name}/{key}"] = float(value)
            elif key == "acc_coverage":
                out[f"{name}/{key}"] = value
    return out


def aggregate_probes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The study's aggregates plus ``<set>/<metric>: [mean, std]`` over seeds.

    Accuracy–coverage curves are averaged point by point (``[means, stds]``).
    """
    aggs = aggregate(rows)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        if "error" not in row:
            groups[(row["dataset"], row["method"], row.get("fraction"))].append(
                _flat(row)
            )
    for a in aggs:
        flats = groups.get((a["dataset"], a["method"], a["fraction"]), [])
        for key in dict.fromkeys(k for f in flats for k in f):
            vals = [f[key] for f in flats if key in f]
            if key.endswith("acc_coverage"):
                cols = list(zip(*vals))
                a[key] = [[_mean_std(list(c))[i] for c in cols] for i in (0, 1)]
            else:
                a[key] = list(_mean_std(vals))
    return aggs


def _cell(a: dict | None, key: str) -> str:
    if a is None or key not in a:
        return "–"
    if "aurc" in key:  # of the order of the error rate (1–3 % on digits)
        return f"{a[key][0]:.4f} ± {a[key][1]:.4f}"
    return f"{a[key][0]:.3f} ± {a[key][1]:.3f}"


def _methods(aggs: list[dict]) -> list[str]:
    return list(dict.fromkeys(a["method"] for a in aggs))


def _table(aggs: list[dict], keys: list[tuple[str, str]], fraction: float) -> list[str]:
    """One row per method at ``fraction`` (methods without M: their one row)."""
    lines = [
        "| method | δ by | " + " | ".join(label for label, _ in keys) + " |",
        "|---" * (len(keys) + 2) + "|",
    ]
    for method in _methods(aggs):
        by_f = {a["fraction"]: a for a in aggs if a["method"] == method}
        a = by_f.get(fraction, by_f.get(None))
        if a is None:
            continue
        cells = " | ".join(_cell(a, k) for _, k in keys)
        lines.append(f"| {method} | {', '.join(a['selection'])} | {cells} |")
    return lines


def _colour(aggs: list[dict], method: str) -> Any:
    """One colour per method of the part, the same in every plot."""
    return plt.get_cmap("tab20")(_methods(aggs).index(method) % 20)


def _lines(ax: Any, aggs: list[dict], key: str, fractions: list[float]) -> None:
    """``key`` against M per method; methods without M as horizontal lines."""
    for method in _methods(aggs):
        by_f = {a["fraction"]: a for a in aggs if a["method"] == method}
        colour = _colour(aggs, method)
        if None in by_f:
            if key in by_f[None]:
                ax.axhline(
                    by_f[None][key][0], ls=":", lw=1.2, color=colour, label=method
                )
            continue
        pts = [(100 * f, by_f[f][key]) for f in fractions if key in by_f.get(f, {})]
        if pts:
            ax.errorbar(
                [p[0] for p in pts],
                [p[1][0] for p in pts],
                yerr=[p[1][1] for p in pts],
                marker="o",
                ms=3,
                capsize=2,
                color=colour,
                ls="--" if "full δ" in method else "-",
                label=method,
            )
    ax.set_xscale("log")
    ax.set_xticks([100 * f for f in fractions], [f"{100 * f:g}" for f in fractions])
    ax.minorticks_off()
    ax.set_xlabel("M (% of N_train)")


def _save(fig: Any, axes: list, path: Path) -> None:
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=6)
    fig.tight_layout(rect=(0, 0.22, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_auroc(aggs: list[dict], fractions: list[float], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))
    for ax, (label, key) in zip(
        axes,
        (("entropy", "ood/auroc_entropy"), ("latent variance", "ood/auroc_variance")),
    ):
        _lines(ax, aggs, key, fractions)
        ax.set_ylabel(f"OOD AUROC ({label})")
        ax.set_title(f"digits 0–4 vs 5–9, score: {label}")
    _save(fig, list(axes), path)


def _plot_coverage(aggs: list[dict], fraction: float, path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 5.2))
    xs = list(COVERAGES)
    for method in _methods(aggs):
        by_f = {a["fraction"]: a for a in aggs if a["method"] == method}
        a = by_f.get(fraction, by_f.get(None))
        if a is not None and "clean/acc_coverage" in a:
            ax.plot(
                xs,
                a["clean/acc_coverage"][0],
                marker=".",
                ms=3,
                color=_colour(aggs, method),
                ls="--" if "full δ" in method else "-",
                label=method,
            )
    ax.set_xlabel("coverage (kept by lowest predictive entropy)")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    _save(fig, [ax], path)


def _plot_severity(sub: list[dict], kind: str, fraction: float, path: Path) -> None:
    task = DATASETS[sub[0]["dataset"]].task
    keys = ["nlpd", "ece", "accuracy"] if task == "classification" else ["nlpd", "rmse"]
    levels = sorted(
        {
            float(k.split("@")[1].split("/")[0])
            for a in sub
            for k in a
            if k.startswith(f"{kind}@")
        }
    )
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.8))
    for ax, key in zip(axes, keys):
        for method in _methods(sub):
            by_f = {a["fraction"]: a for a in sub if a["method"] == method}
            a = by_f.get(fraction, by_f.get(None))
            if a is None or key not in a:
                continue
            ys = [a[key][0]] + [
                a.get(f"{kind}@{s:g}/{key}", [math.nan])[0] for s in levels
            ]
            ax.plot(
                [0.0, *levels],
                ys,
                marker="o",
                ms=3,
                color=_colour(sub, method),
                ls="--" if "full δ" in method else "-",
                label=method,
            )
        ax.set_xlabel(f"{kind} severity")
        ax.set_ylabel(key)
        if key == "nlpd":
            ax.set_yscale("log")
    fig.suptitle(f"{sub[0]['dataset']}, {kind}, M = {fraction:.0%}")
    _save(fig, list(axes), path)


def _severity_table(sub: list[dict], kind: str, fraction: float) -> list[str]:
    task = DATASETS[sub[0]["dataset"]].task
    levels = sorted(
        {
            float(k.split("@")[1].split("/")[0])
            for a in sub
            for k in a
            if k.startswith(f"{kind}@")
        }
    )
    metrics = (
        ["nlpd", "ece", "accuracy"] if task == "classification" else ["nlpd", "rmse"]
    )
    keys = []
    for m in metrics:
        keys.append((f"{m} clean", m))
        keys += [(f"{m} @{s:g}", f"{kind}@{s:g}/{m}") for s in levels]
    return _table(sub, keys, fraction)


def write_part_report(
    records: list[dict], out: Path, command: str, run: dict | None, part: str
) -> dict[str, Any]:
    """Write ``RESULTS.md``, ``results.json`` and the plots of one part.

    Parameters
    ----------
    records : list of dict
        Task records (``runner.run_study``).
    out : Path
        Output folder.
    command : str
        The command line.
    run : dict, optional
        Run record (``run.json``).
    part : {'ood', 'shift'}
        The part.

    Returns
    -------
    dict
        What was written to ``results.json``.

    """
    rows = [r for rec in records for r in rec["rows"]]
    aggs = aggregate_probes(rows)
    effects = location_effects(aggs, part)
    result = {
        "command": command,
        "part": part,
        "run": run or {},
        "meta": [r["meta"] for r in records],
        "aggregate": aggs,
        "location_effects": effects,
        "rows": rows,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    title = {"ood": "held-out classes", "shift": "dataset shift"}[part]
    lines = [
        f"# Real-data study, {title} (`--part {part}`)",
        "",
        f"Command: `{command}`",
        "",
        "Mean ± standard deviation over seeds; protocol: `studies/real/README.md`.",
        "",
        *_run_text(run, records),
    ]
    lines += [*location_markdown(effects), ""]
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        sub = [a for a in aggs if a["dataset"] == ds]
        fractions = sorted({a["fraction"] for a in sub if a["fraction"] is not None})
        seeds = sorted({r["seed"] for r in rows if r["dataset"] == ds})
        lines += [f"## {ds} (seeds {seeds})", ""]
        lines += _part_sections(part, ds, sub, fractions, out)
    (out / "RESULTS.md").write_text("\n".join(lines) + "\n")
    return result


def _part_sections(part: str, ds: str, sub: list[dict], fractions, out: Path) -> list:
    lines: list[str] = []
    classification = DATASETS[ds].task == "classification"
    sel = [
        ("AURC (entropy)", "clean/aurc_entropy"),
        ("AURC (variance)", "clean/aurc_variance"),
    ]
    if part == "ood":
        keys = [
            ("AUROC (entropy)", "ood/auroc_entropy"),
            ("AUROC (variance)", "ood/auroc_variance"),
            *sel,
            ("test NLPD", "nlpd"),
            ("ECE", "ece"),
            ("accuracy", "accuracy"),
        ]
        for f in fractions:
            lines += [f"### M = {f:.0%}", "", *_table(sub, keys, f), ""]
        _plot_auroc(sub, fractions, out / "auroc_vs_m.png")
        lines += ["![OOD AUROC against M](auroc_vs_m.png)", ""]
        lines += ["### Published OOD AUROCs (not comparable: other data, networks)", ""]
        lines += [*_published_table(), "", OOD_PROTOCOL_NOTE, ""]
    else:
        plot_m = fractions[-1]
        kinds = sorted({k.split("@")[0] for a in sub for k in a if "@" in k})
        for kind in kinds:
            png = f"shift_{ds}_{kind}.png"
            _plot_severity(sub, kind, plot_m, out / png)
            lines += [
                f"### {kind}, M = {plot_m:.0%}",
                "",
                *_severity_table(sub, kind, plot_m),
                "",
                f"![{kind}]({png})",
                "",
            ]
        if classification:
            for f in fractions:
                lines += [
                    f"### Selective prediction, clean test, M = {f:.0%}",
                    "",
                    *_table(sub, sel, f),
                    "",
                ]
    if classification:
        f = fractions[-1]
        png = f"coverage_{ds}.png"
        _plot_coverage(sub, f, out / png, f"{ds}, accuracy–coverage, M = {f:.0%}")
        lines += [f"![accuracy against coverage]({png})", ""]
    return lines


def _published_table() -> list[str]:
    lines = [
        "| method | data set, network | M | OOD AUROC | source |",
        "|---" * 5 + "|",
    ]
    for p in OOD_PUBLISHED:
        lines.append(
            f"| {p['method']} | {p['setting']} | {p['m']} | {p['auroc']} | "
            f"{p['source']} |"
        )
    return lines
