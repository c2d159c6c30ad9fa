"""``python -m studies.real.uncertainty --part {ood,shift} --quick`` end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from studies.real.corruptions import SEVERITIES
from studies.real.methods import METHODS

ROOT = Path(__file__).resolve().parents[3]
NO_M = {"MAP", "FullLaplace", "FullLaplace (val-δ)"} | {
    name for name, spec in METHODS.items() if spec.locations == "none"
}


def _run(part: str, out: Path) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "studies.real.uncertainty",
            "--part",
            part,
            "--quick",
            "--workers",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("RESULTS.md", "results.json", "run.json", "config.json"):
        assert (out / name).stat().st_size > 0
    result = json.loads((out / "results.json").read_text())
    assert not [r for r in result["rows"] if "error" in r]
    for r in result["rows"]:
        if r["method"] in NO_M:
            assert r.get("fraction") is None
        else:
            assert r["fraction"] is not None
    return result


def _rows_of(result: dict, ds: str) -> set[str]:
    return {r["method"] for r in result["rows"] if r["dataset"] == ds}


@pytest.mark.slow
def test_ood_part_quick(tmp_path: Path) -> None:
    result = _run("ood", tmp_path)
    assert _rows_of(result, "digits") == set(METHODS) | NO_M
    for r in result["rows"]:
        auroc = r["probe"]["ood"]
        assert 0 <= auroc["auroc_entropy"] <= 1 and 0 <= auroc["auroc_variance"] <= 1
        clean = r["probe"]["clean"]
        assert 0 <= clean["aurc_entropy"] <= 1
        assert len(clean["acc_coverage"]) == 20
        assert clean["acc_coverage"][-1] == pytest.approx(r["accuracy"])
    map_row = next(r for r in result["rows"] if r["method"] == "MAP")
    assert map_row["probe"]["ood"]["auroc_variance"] == 0.5  # no variance: all ties
    assert map_row["probe"]["clean"]["aurc_variance"] == pytest.approx(
        1 - map_row["accuracy"]
    )
    assert {e["protocol"] for e in result["location_effects"]} >= {
        "common δ (full Laplace's evidence)"
    }
    assert (tmp_path / "auroc_vs_m.png").stat().st_size > 0
    assert (tmp_path / "coverage_digits.png").stat().st_size > 0
    md = (tmp_path / "RESULTS.md").read_text()
    assert "AUROC (entropy)" in md and "Optimised against random" in md


@pytest.mark.slow
def test_shift_part_quick(tmp_path: Path) -> None:
    result = _run("shift", tmp_path)
    for ds, kinds in (("digits", ("noise", "rotation")), ("diabetes", ("range",))):
        rows = [r for r in result["rows"] if r["dataset"] == ds]
        assert {r["method"] for r in rows} == set(METHODS) | NO_M
        for r in rows:
            want = {f"{k}@{s:g}" for k in kinds for s in SEVERITIES[k][1:]}
            assert want <= set(r["probe"])
            for name in want:
                assert math.isfinite(r["probe"][name]["nlpd"])
        png = [f"shift_{ds}_{k}.png" for k in kinds]
        assert all((tmp_path / p).stat().st_size > 0 for p in png)
    digits = next(
        r for r in result["rows"] if r["dataset"] == "digits" and r["method"] == "MAP"
    )
    assert digits["probe"]["rotation@45"]["accuracy"] < digits["accuracy"]
    md = (tmp_path / "RESULTS.md").read_text()
    assert "rotation, M = 2%" in md and "Selective prediction" in md
