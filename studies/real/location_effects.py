"""Where optimised locations help detection, selective prediction and shift.

For each posterior with locations (``ContextPosterior``, ``LocationFunctionalLaplace``)
and each way of choosing δ (its own, by validation, the full Laplace's evidence δ
common to both rows), the optimised row is compared with the random-subset row it
starts from in every (data set, M) cell, per metric: out-of-distribution AUROC
(higher is better), AURC (lower), and NLPD and ECE at the mildest and the
strongest corruption of each kind (lower). Counted, not judged: what they say is
in the README.
"""

from __future__ import annotations

from typing import Any

from .criteria import COMMON_DELTA_PAIRS, PAIRS

__all__ = ["PAIR_PROTOCOLS", "TIE", "location_effects", "location_markdown"]

#: Differences of at most this size count as ties (neither better nor worse).
TIE = 1e-6

#: protocol -> posterior -> (random row, optimised row)
PAIR_PROTOCOLS: dict[str, dict[str, tuple[str, ...]]] = {
    "own δ (evidence / val-grid)": dict(PAIRS),
    "val-δ": {
        "ContextPosterior": ("SFR-like CP (random) (val-δ)", "CP (optimised) (val-δ)")
    },
    "common δ (full Laplace's evidence)": dict(COMMON_DELTA_PAIRS),
}


def _metrics(aggs: list[dict[str, Any]], part: str) -> list[tuple[str, bool]]:
    """(key, higher is better) of the part; mildest and strongest severities."""
    keys = {k for a in aggs for k in a if "/" in k and not k.endswith("coverage")}
    out = [(k, True) for k in ("ood/auroc_entropy", "ood/auroc_variance") if k in keys]
    out += [
        (k, False) for k in ("clean/aurc_entropy", "clean/aurc_variance") if k in keys
    ]
    if part == "shift":
        levels: dict[str, set[float]] = {}
        for k in (k for k in keys if "@" in k):
            kind, rest = k.split("@")
            levels.setdefault(kind, set()).add(float(rest.split("/")[0]))
        for kind, sevs in sorted(levels.items()):
            for sev in sorted({min(sevs), max(sevs)}):
                out += [
                    (f"{kind}@{sev:g}/{m}", False)
                    for m in ("nlpd", "ece")
                    if f"{kind}@{sev:g}/{m}" in keys
                ]
    return out


def location_effects(aggs: list[dict[str, Any]], part: str) -> list[dict[str, Any]]:
    """One entry per (protocol, posterior, metric): in how many cells it helps.

    Parameters
    ----------
    aggs : list of dict
        ``uncertainty_report.aggregate_probes`` output.
    part : {'ood', 'shift'}
        The part.

    Returns
    -------
    list of dict
        ``protocol, posterior, metric, higher_better, better, worse, cells,
        mean_diff`` (optimised − random, mean over cells) and ``diffs`` per cell.

    """
    index = {(a["dataset"], a["method"], a["fraction"]): a for a in aggs}
    cells = sorted({(a["dataset"], a["fraction"]) for a in aggs if a["fraction"]})
    out = []
    for protocol, pairs in PAIR_PROTOCOLS.items():
        for posterior, (rand, opt) in pairs.items():
            for key, higher in _metrics(aggs, part):
                diffs = {}
                for ds, f in cells:
                    a, b = index.get((ds, rand, f)), index.get((ds, opt, f))
                    if a and b and key in a and key in b:
                        diffs[f"{ds} {f:.0%}"] = b[key][0] - a[key][0]
                if not diffs:
                    continue
                sign = 1.0 if higher else -1.0
                better = sum(sign * d > TIE for d in diffs.values())
                worse = sum(sign * d < -TIE for d in diffs.values())
                out.append(
                    {
                        "protocol": protocol,
                        "posterior": posterior,
                        "metric": key,
                        "higher_better": higher,
                        "better": better,
                        "worse": worse,
                        "cells": len(diffs),
                        "mean_diff": sum(diffs.values()) / len(diffs),
                        "diffs": diffs,
                    }
                )
    return out


def location_markdown(effects: list[dict[str, Any]]) -> list[str]:
    """Markdown table of :func:`location_effects`."""
    lines = [
        "## Optimised against random locations",
        "",
        "Cells (data set, M) where the optimised row is better than the random row "
        "it starts from (better / worse by more than 1e-6; the rest are ties), mean "
        "difference optimised − random.",
        "",
        "| δ | posterior | metric | better | worse | mean Δ | Δ per cell |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in effects:
        arrow = "↑" if e["higher_better"] else "↓"
        per = ", ".join(f"{k}: {v:+.4f}" for k, v in e["diffs"].items())
        lines.append(
            f"| {e['protocol']} | {e['posterior']} | {e['metric']} {arrow} | "
            f"{e['better']} of {e['cells']} | {e['worse']} | {e['mean_diff']:+.2e} "
            f"| {per} |"
        )
    return lines
