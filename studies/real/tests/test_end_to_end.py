"""``python -m studies.real --quick`` end to end, and the rows laplace-torch offers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from laplace import baselaplace

from studies.real.methods import METHODS

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_quick_study_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "studies.real",
            "--quick",
            "--workers",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = ("RESULTS.md", "results.json", "run.json", "nlpd_vs_m.png", "nlpd_wine.png")
    for name in (*names, "nlpd_diabetes.png"):
        assert (tmp_path / name).stat().st_size > 0
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["rows"]
    assert not [r for r in rows if "error" in r]
    for ds in ("wine", "diabetes"):
        got = {(r["method"], r.get("fraction")) for r in rows if r["dataset"] == ds}
        per_m = [m for m, spec in METHODS.items() if spec.locations != "none"]
        once = [m for m, spec in METHODS.items() if spec.locations == "none"]
        want = {(m, f) for m in per_m for f in (0.05, 0.2)}
        base = {("MAP", None), ("FullLaplace", None), ("FullLaplace (val-δ)", None)}
        assert want | base | {(m, None) for m in once} == got
    for r in rows:
        assert math.isfinite(r["nlpd"])
        if r["method"] not in ("MAP",):
            assert r["delta"] > 0 and 0 <= r["share_below"] <= 1
            assert r["log_var_error"] >= 0
        if r["task"] == "classification":
            assert 0 <= r["ece"] <= 1 and 0 <= r["accuracy"] <= 1
    md = (tmp_path / "RESULTS.md").read_text()
    assert "## wine" in md and "## diabetes" in md and "val-grid" in md
    assert "## Criteria" in md and "Wall time (the whole run)" in md
    pairs = result["criteria"]["pairs"]
    assert len(pairs) == 2 * 2 * 2  # data sets × M × posteriors
    assert {r["selection"] for r in rows if r["method"] == "SFR-like CP (random)"} == {
        "evidence"
    }
    assert len(result["criteria"]["common_delta"]["pairs"]) == 2 * 2 * 2
    full_delta = {
        (r["dataset"], r["seed"]): r["delta"]
        for r in rows
        if r["method"] == "FullLaplace"
    }
    common = [r for r in rows if r["method"].endswith("at full δ")]
    assert len(common) == 2 * 2 * 2 * 2  # data sets × M × posteriors × locations
    for r in common:
        assert r["delta"] == full_delta[(r["dataset"], r["seed"])]


def test_ella_and_valla_rows_exactly_when_laplace_torch_has_them() -> None:
    has = hasattr(baselaplace, "ELLA")
    assert ("ELLA" in METHODS) == has and ("VaLLA" in METHODS) == has
    assert {"GP-subset", "CP (optimised)", "LFL full-Λ (optimised)"} <= set(METHODS)
    assert {"LLLaplace", "LLLaplace (val-δ)", "GP-subset (val-δ)"} <= set(METHODS)
