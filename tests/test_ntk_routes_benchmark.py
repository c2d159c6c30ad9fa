"""``benchmarks/jacobians/ntk_routes.py`` in its quick mode: every route runs or says
why not, every Gram that it times agrees with the per-layer factor route's, each
allocator setting has its run, FLOPs stand beside the times, and the Markdown report
renders again from the JSON.

No timing is asserted: quick-mode timings are single cold runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/jacobians/ntk_routes.py"


@pytest.mark.slow
def test_quick_ntk_routes_run_and_agree(tmp_path: Path) -> None:
    out, report = tmp_path / "routes.json", tmp_path / "NTK_ROUTES.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--repeats", "1"]
        + ["--allocator", "default", "mmap-off"]
        + ["--out", str(out), "--markdown", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [run["allocator"] for run in results["runs"]] == ["default", "mmap-off"]
    for run in results["runs"]:
        assert run["device"] == "cpu" and run["matmul_gflop_per_s"] > 0
        assert set(run["cases"]) == {"mlp", "cnn", "transformer"}
        for case in run["cases"].values():
            rows = case["routes"]
            # the routes this package owns never fail
            factors, jacobians = rows["factors"], rows["jacobians"]
            assert "seconds" in factors and "seconds" in jacobians
            # forming J is more work, counted and by the cost model
            assert jacobians["gflop"] > factors["gflop"] > 0
            assert jacobians["model_gmac"] > factors["model_gmac"] > 0
            for row in rows.values():
                if "error" in row:
                    continue
                assert row["seconds"] > 0 and row["gflop_per_s"] > 0
                assert row["max relative difference to factors"] < 1e-4
    text = report.read_text()
    assert "| model | B | allocator | route | seconds | × factors | GFLOP |" in text
    assert "### Issue #28's targets, allocator `mmap-off`" in text
    again = tmp_path / "AGAIN.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--report-from", str(out)]
        + ["--markdown", str(again)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert again.read_text() == text
