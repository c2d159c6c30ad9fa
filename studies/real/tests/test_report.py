"""Task order, records on disk, aggregation over seeds and the criteria check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from studies.real.criteria import check_criteria, criteria_markdown
from studies.real.report import aggregate
from studies.real.runner import load_records, task_order


def test_task_order_covers_every_task_once_largest_data_set_last() -> None:
    order = task_order(["big", "a", "b"], [1, 2, 3])
    assert sorted(order) == sorted((d, s) for d in ("big", "a", "b") for s in (1, 2, 3))
    assert order[:3] == [("big", 1), ("a", 1), ("b", 1)]
    assert order[-2:] == [("big", 2), ("big", 3)]


def test_aggregate_mean_and_sample_std() -> None:
    rows = [
        {
            "dataset": "d",
            "method": "A",
            "fraction": 0.1,
            "m": 3,
            "nlpd": v,
            "selection": "x",
        }
        for v in (1.0, 2.0, 4.0)
    ] + [{"dataset": "d", "method": "A", "fraction": 0.1, "m": 3, "error": "E: e"}]
    (agg,) = aggregate(rows)
    assert agg["nlpd"][0] == pytest.approx(7 / 3)
    assert agg["nlpd"][1] == pytest.approx(np.std([1.0, 2.0, 4.0], ddof=1))
    assert agg["n_seeds"] == 3 and agg["errors"] == ["E: e"]


def _agg(ds: str, method: str, frac: float, nlpd: float, lv: float) -> dict:
    return {
        "dataset": ds,
        "method": method,
        "fraction": frac,
        "nlpd": [nlpd, 0.0],
        "log_var_error": [lv, 0.0],
    }


def test_criteria_by_hand() -> None:
    aggs = [
        # digits 1 %: CP optimised better in both; LFL optimised worse NLPD
        _agg("digits", "SFR-like CP (random)", 0.01, 0.50, 0.30),
        _agg("digits", "CP (optimised)", 0.01, 0.40, 0.20),
        _agg("digits", "LFL full-Λ (random)", 0.01, 0.20, 1.00),
        _agg("digits", "LFL full-Λ (optimised)", 0.01, 0.21, 0.90),
        # digits 20 %: log-var worse but M > 10 %, so not required
        _agg("digits", "SFR-like CP (random)", 0.20, 0.12, 0.10),
        _agg("digits", "CP (optimised)", 0.20, 0.12, 0.15),
        _agg("digits", "GP-subset", 0.20, 0.01, 0.0),  # not ours: not the best row
    ]
    out = check_criteria(aggs)
    assert out["nlpd_never_worse"] is False
    assert out["nlpd_failures"] == ["digits M=1% LocationFunctionalLaplace"]
    assert out["log_var_better_m_le_10"] is True
    by = {(p["fraction"], p["posterior"]): p for p in out["pairs"]}
    assert by[(0.20, "ContextPosterior")]["log_var_better"] is None
    assert by[(0.01, "ContextPosterior")]["nlpd"]["diff"] == pytest.approx(-0.10)
    sfr = {s["fraction"]: s for s in out["sfr"]}
    assert sfr[0.01]["best_ours"] == "LFL full-Λ (random)" and sfr[0.01]["beats_sfr"]
    assert sfr[0.20]["best_ours_nlpd"] == 0.12 and not sfr[0.20]["beats_sfr"]
    assert out["sfr_behind"] == ["M=20%"]
    assert "**FAILED**" in "\n".join(criteria_markdown(out))
    assert out["common_delta"]["pairs"] == []  # no common-δ rows given
    common = [
        _agg("digits", "CP (random) at full δ", 0.01, 0.50, 0.30),
        _agg("digits", "CP (optimised) at full δ", 0.01, 0.45, 0.35),
    ]
    out = check_criteria(aggs + common)["common_delta"]
    assert [p["posterior"] for p in out["pairs"]] == ["ContextPosterior"]
    assert out["nlpd_never_worse"] is True and out["log_var_better_m_le_10"] is False
    assert out["log_var_failures"] == ["digits M=1% ContextPosterior"]
    assert "one common δ" in "\n".join(criteria_markdown(check_criteria(aggs + common)))


def test_location_criterion_counts_cells_at_the_common_delta() -> None:
    common = [
        # CP: better NLPD at 1 % and 5 %, worse at 2 %; log-var lower at 1 %, 2 %, 5 %
        _agg("wine", "CP (random) at full δ", 0.01, 0.50, 0.30),
        _agg("wine", "CP (optimised) at full δ", 0.01, 0.45, 0.20),
        _agg("wine", "CP (random) at full δ", 0.02, 0.50, 0.30),
        _agg("wine", "CP (optimised) at full δ", 0.02, 0.55, 0.20),
        _agg("wine", "CP (random) at full δ", 0.05, 0.50, 0.30),
        _agg("wine", "CP (optimised) at full δ", 0.05, 0.40, 0.20),
        # LFL: better NLPD, higher log-var error (not counted for the criterion)
        _agg("wine", "LFL full-Λ (random) at full δ", 0.01, 0.30, 1.0),
        _agg("wine", "LFL full-Λ (optimised) at full δ", 0.01, 0.20, 2.0),
    ]
    loc = check_criteria(common)["location"]
    assert (loc["nlpd_better"], loc["nlpd_cells"]) == (3, 4)
    assert (loc["log_var_better"], loc["log_var_cells"]) == (3, 3)
    assert loc["met"] is True  # 3 of 4 = 75 %
    common[3]["log_var_error"] = [0.5, 0.0]  # CP 2 %: log-var now worse: 2 of 3
    assert check_criteria(common)["location"]["met"] is False
    md = "\n".join(criteria_markdown(check_criteria(common)))
    assert "**Location criterion**" in md and "2 of 3" in md
    assert check_criteria([])["location"]["met"] is None


def test_load_records_prefers_finished_then_partial(tmp_path: Path) -> None:
    (tmp_path / "a_1.json").write_text(json.dumps({"meta": {"k": "done"}, "rows": []}))
    (tmp_path / "a_1.partial.json").write_text(json.dumps({"meta": {"k": "p"}}))
    (tmp_path / "b_1.partial.json").write_text(
        json.dumps({"meta": {"k": "partial"}, "rows": []})
    )
    got = load_records(tmp_path, [("a", 1), ("b", 1), ("c", 1)])
    assert [r["meta"]["k"] for r in got] == ["done", "partial"]
