"""The study's acceptance criteria, checked on the aggregated rows.

**Location criterion (restated):** the comparison at one common ``δ``, the full
Laplace's evidence ``δ`` (at which the locations are optimised), so that only the
locations differ between the random and the optimised row: optimised better than
random in mean test NLPD in at least three quarters of the (data set, M,
posterior) cells, and ``ContextPosterior``'s mean ``|log var − log var_full|``
lower in at least three quarters of its cells with M ≤ 10 %
(``LocationFunctionalLaplace``'s is reported: it sits below the full posterior's by
its subset-of-data factor, which locations cannot change). The earlier wording,
under each method's own choice of ``δ``, asked optimised locations never to be
worse; it is kept as reported information, not as a criterion:

1. Optimised never worse than the random subset it starts from in mean test NLPD,
   for each posterior, data set and M (each row at its own ``δ``).
2. Better in mean ``|log var − log var_full|`` at every M ≤ 10 % (the same).
3. On digits, our best row (the package's posteriors, random or optimised) against
   SFR's published NLPD at each M (reported, "behind" where it is not lower).

Every comparison is a row with both means, the difference and a verdict; nothing is
dropped when it fails.
"""

from __future__ import annotations

import math
from typing import Any

from .published import SFR_DIGITS

__all__ = [
    "COMMON_DELTA_PAIRS",
    "LOCATION_SHARE",
    "OURS",
    "PAIRS",
    "check_criteria",
    "criteria_markdown",
    "location_criterion",
]

#: Share of cells in which optimised locations must be better (restated criterion).
LOCATION_SHARE = 0.75

#: (random-subset row, optimised row) per posterior.
PAIRS = {
    "ContextPosterior": ("SFR-like CP (random)", "CP (optimised)"),
    "LocationFunctionalLaplace": ("LFL full-Λ (random)", "LFL full-Λ (optimised)"),
}
#: The same pairs at the full Laplace's evidence δ (one δ for both rows).
COMMON_DELTA_PAIRS = {
    posterior: tuple(f"{name} at full δ" for name in pair)
    for posterior, pair in {
        "ContextPosterior": ("CP (random)", "CP (optimised)"),
        "LocationFunctionalLaplace": (
            "LFL full-Λ (random)",
            "LFL full-Λ (optimised)",
        ),
    }.items()
}
#: Rows that are this package's posteriors.
OURS = tuple(
    name for pairs in (PAIRS, COMMON_DELTA_PAIRS) for p in pairs.values() for name in p
)


def _mean(agg: dict[str, Any] | None, key: str) -> float | None:
    if agg is None or key not in agg:
        return None
    return float(agg[key][0])


def _pair_rows(
    aggs: list[dict[str, Any]], pairs: dict[str, tuple[str, ...]]
) -> list[dict[str, Any]]:
    index = {(a["dataset"], a["method"], a["fraction"]): a for a in aggs}
    keys = sorted({(a["dataset"], a["fraction"]) for a in aggs if a["fraction"]})
    out = []
    for ds, frac in keys:
        for posterior, (rand, opt) in pairs.items():
            if (ds, rand, frac) not in index and (ds, opt, frac) not in index:
                continue
            a, b = index.get((ds, rand, frac)), index.get((ds, opt, frac))
            row: dict[str, Any] = {
                "dataset": ds,
                "fraction": frac,
                "posterior": posterior,
            }
            for key in ("nlpd", "log_var_error"):
                r, o = _mean(a, key), _mean(b, key)
                row[key] = {"random": r, "optimised": o}
                row[key]["diff"] = None if r is None or o is None else o - r
            full = index.get((ds, "FullLaplace", None))
            row["delta"] = {
                "random": _mean(a, "delta"),
                "optimised": _mean(b, "delta"),
                "full": _mean(full, "delta"),
            }
            d_nlpd = row["nlpd"]["diff"]
            row["nlpd_not_worse"] = None if d_nlpd is None else d_nlpd <= 0
            d_lv = row["log_var_error"]["diff"]
            needed = frac <= 0.10 + 1e-12
            row["log_var_better"] = None if d_lv is None or not needed else d_lv < 0
            out.append(row)
    return out


def _sfr_rows(aggs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    published = SFR_DIGITS["SFR (published)"]
    out = []
    for frac, value in sorted(published.items()):
        ours = [
            a
            for a in aggs
            if a["dataset"] == "digits"
            and a["method"] in OURS
            and a["fraction"] is not None
            and abs(a["fraction"] - frac) < 1e-9
            and "nlpd" in a
        ]
        if not ours:
            continue
        best = min(ours, key=lambda a: a["nlpd"][0])
        out.append(
            {
                "fraction": frac,
                "sfr_published": value,
                "best_ours": best["method"],
                "best_ours_nlpd": best["nlpd"][0],
                "beats_sfr": best["nlpd"][0] < value,
            }
        )
    return out


def location_criterion(common_pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """The restated location criterion on the common-δ pairs (module docstring).

    Parameters
    ----------
    common_pairs : list of dict
        Pairs at the full Laplace's evidence δ (``_pair_rows``).

    Returns
    -------
    dict
        ``nlpd_better``/``nlpd_cells`` (all posteriors), ``log_var_better``/
        ``log_var_cells`` (``ContextPosterior``, M ≤ 10 %), ``met`` (``None``
        without cells) and ``share`` (the threshold).

    """
    nlpd = [p["nlpd"]["diff"] for p in common_pairs if p["nlpd"]["diff"] is not None]
    lv = [
        p["log_var_error"]["diff"]
        for p in common_pairs
        if p["posterior"] == "ContextPosterior" and p["log_var_better"] is not None
    ]
    out: dict[str, Any] = {
        "nlpd_better": sum(d < 0 for d in nlpd),
        "nlpd_cells": len(nlpd),
        "log_var_better": sum(d < 0 for d in lv),
        "log_var_cells": len(lv),
        "share": LOCATION_SHARE,
    }
    if not nlpd or not lv:
        out["met"] = None
    else:
        out["met"] = out["nlpd_better"] >= LOCATION_SHARE * len(nlpd) and out[
            "log_var_better"
        ] >= LOCATION_SHARE * len(lv)
    return out


def check_criteria(aggs: list[dict[str, Any]]) -> dict[str, Any]:
    """Evaluate the criteria on aggregated rows (see module docstring).

    Parameters
    ----------
    aggs : list of dict
        :func:`~studies.real.report.aggregate` output.

    Returns
    -------
    dict
        ``pairs`` (one row per data set, M and posterior), ``sfr`` (digits),
        and the overall verdicts ``nlpd_never_worse``, ``log_var_better_m_le_10``
        (``None`` when nothing could be compared) and the failing cases.

    """
    sfr = _sfr_rows(aggs)
    verdicts = _verdicts(_pair_rows(aggs, PAIRS))
    common = _pair_rows(aggs, COMMON_DELTA_PAIRS)
    failing = [p for p in verdicts["pairs"] if p["nlpd_not_worse"] is False]
    return {
        **verdicts,
        "sfr": sfr,
        "nlpd_failures_delta_closer_to_full": [
            _label(p) for p in failing if _closer_to_full(p["delta"])
        ],
        "sfr_behind": [f"M={s['fraction']:.0%}" for s in sfr if not s["beats_sfr"]],
        "common_delta": _verdicts(common),
        "location": location_criterion(common),
    }


def _label(p: dict[str, Any]) -> str:
    return f"{p['dataset']} M={p['fraction']:.0%} {p['posterior']}"


def _verdicts(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Overall verdicts of criteria 1 and 2 over compared pairs, and the failures."""
    nlpd = [p for p in pairs if p["nlpd_not_worse"] is not None]
    lv = [p for p in pairs if p["log_var_better"] is not None]
    return {
        "pairs": pairs,
        "nlpd_never_worse": all(p["nlpd_not_worse"] for p in nlpd) if nlpd else None,
        "nlpd_failures": [_label(p) for p in nlpd if not p["nlpd_not_worse"]],
        "log_var_better_m_le_10": all(p["log_var_better"] for p in lv) if lv else None,
        "log_var_failures": [_label(p) for p in lv if not p["log_var_better"]],
    }


def _closer_to_full(delta: dict[str, float | None]) -> bool:
    """Whether the optimised row's mean δ is closer to the full Laplace's (in log)."""
    r, o, f = delta["random"], delta["optimised"], delta["full"]
    if r is None or o is None or f is None:
        return False
    return abs(math.log(o / f)) < abs(math.log(r / f))


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def _deltas(delta: dict[str, float | None]) -> str:
    return " / ".join(
        "–" if v is None else f"{v:.3g}"
        for v in (delta["random"], delta["optimised"], delta["full"])
    )


def _verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("yes" if ok else "**NO**")


def _failures(ok: bool | None, failures: list[str]) -> str:
    yes = {True: "met", False: "**FAILED**", None: "not evaluated"}
    return yes[ok] + (f" (fails: {'; '.join(failures)})" if failures else "")


def _pairs_table(pairs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| data set | M | posterior | NLPD random | NLPD optimised | Δ | not worse "
        "| log-var err random | optimised | Δ | better (M ≤ 10 %) "
        "| δ random / optimised / full |",
        "|---" * 12 + "|",
    ]
    for p in pairs:
        n, v = p["nlpd"], p["log_var_error"]
        lines.append(
            f"| {p['dataset']} | {p['fraction']:.0%} | {p['posterior']} | "
            f"{_fmt(n['random'])} | {_fmt(n['optimised'])} | {_fmt(n['diff'], True)} | "
            f"{_verdict(p['nlpd_not_worse'])} | {_fmt(v['random'])} | "
            f"{_fmt(v['optimised'])} | {_fmt(v['diff'], True)} | "
            f"{_verdict(p['log_var_better'])} | {_deltas(p['delta'])} |"
        )
    return lines


def _verdict_bullets(verdicts: dict[str, Any]) -> list[str]:
    """Criteria 1 and 2 as two Markdown bullets (see :func:`_verdicts`)."""
    return [
        "* Optimised never worse than its random start in mean test NLPD: "
        + _failures(verdicts["nlpd_never_worse"], verdicts["nlpd_failures"]),
        "* Optimised better in mean |log var − log var_full| at every M ≤ 10 %: "
        + _failures(verdicts["log_var_better_m_le_10"], verdicts["log_var_failures"]),
    ]


def criteria_markdown(result: dict[str, Any]) -> list[str]:
    """Markdown lines for :func:`check_criteria`'s result."""
    loc = result.get("location") or location_criterion([])
    lines = [
        "## Criteria (checked automatically, `studies/real/criteria.py`)",
        "",
        "* **Location criterion** (restated: the comparison at one common δ, the "
        "full Laplace's evidence δ, table below): optimised better than random in "
        f"mean test NLPD in {loc['nlpd_better']} of {loc['nlpd_cells']} cells, the "
        "context posterior's log-var error lower in "
        f"{loc['log_var_better']} of {loc['log_var_cells']} cells with M ≤ 10 %: "
        + {True: "met", False: "**FAILED**", None: "not evaluated"}[loc["met"]]
        + f" (needs at least {loc['share']:.0%} of the cells in each)",
        "",
        "Reported, no longer a criterion: the same comparison with each row at its "
        "own δ (the earlier wording, which asked optimised locations never to be "
        "worse under each method's own δ selection):",
        "",
        *_verdict_bullets(result),
        "* Of the NLPD failures, those where the optimised row's own δ (mean over "
        "seeds) is closer to the full Laplace's δ than the random row's: "
        f"{len(result['nlpd_failures_delta_closer_to_full'])} of "
        f"{len(result['nlpd_failures'])} (the tighter evidence bound moves δ "
        "towards the full posterior's; where that posterior is less well "
        "calibrated than the MAP, NLPD follows it)",
        "* Digits, our best row below SFR's published NLPD: "
        + (
            "at every M"
            if result["sfr"] and not result["sfr_behind"]
            else f"behind at {', '.join(result['sfr_behind']) or '–'}"
        ),
        "",
        *_pairs_table(result["pairs"]),
    ]
    common = result.get("common_delta")
    if common and common["pairs"]:
        lines += [
            "",
            "### The location criterion: the comparison at one common δ",
            "",
            "Random and optimised locations at the full Laplace's evidence δ, the δ "
            "the locations were optimised at, so that only the locations differ.",
            "",
            *_verdict_bullets(common),
            "",
            *_pairs_table(common["pairs"]),
        ]
    if result["sfr"]:
        lines += [
            "",
            "| digits M | SFR published | our best row | its NLPD | ours lower |",
            "|---|---|---|---|---|",
        ]
        for s in result["sfr"]:
            lines.append(
                f"| {s['fraction']:.0%} | {s['sfr_published']:.3f} | {s['best_ours']} "
                f"| {s['best_ours_nlpd']:.3f} | {_verdict(s['beats_sfr'])} |"
            )
    return lines
