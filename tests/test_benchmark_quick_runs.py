"""The smaller benchmark scripts run in their quick modes and print what they record.

No timing is asserted: quick-mode timings are single cold runs. The larger
benchmarks have a test module each (``test_benchmarks.py``,
``test_ntk_routes_benchmark.py``, ``test_scaling_benchmark.py``,
``test_distributed_fit_benchmark.py``, ``clients/test_bayesopt_benchmark.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTEXT_UPDATE = ROOT / "benchmarks/context_posterior/context_update.py"
CONTEXT_NUMERICS = ROOT / "benchmarks/context_posterior/context_numerics.py"
OPTIMIZER_DEFAULTS = ROOT / "benchmarks/optimizer/optimizer_defaults.py"
PROFILE_ENGINE = ROOT / "benchmarks/jacobians/profile_engine.py"
SMALL_NTK_CALLS = ROOT / "benchmarks/jacobians/small_ntk_calls.py"
ROUTE_COSTS = ROOT / "benchmarks/jacobians/route_costs.py"


def _run(script: Path, *args: str) -> str:
    """``python SCRIPT ARGS`` from the repository root; its standard output."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_quick_context_update_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "CONTEXT_UPDATE.md"
    _run(CONTEXT_UPDATE, "--quick", "--out", str(out))
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 2")]
    assert len(rows) == 2
    for row in rows:
        update, refit = (float(c) for c in row.split("|")[5:7])
        assert update > 0 and refit > 0


@pytest.mark.slow
def test_quick_context_numerics_timing_rows(tmp_path: Path) -> None:
    out = tmp_path / "timing.json"
    _run(CONTEXT_NUMERICS, "timing", "--quick", "--out", str(out))
    (row,) = json.loads(out.read_text())
    assert all(row[key] > 0 for key in ("fit", "predict", "evidence", "search"))


@pytest.mark.slow
def test_quick_optimizer_minibatch_rows(tmp_path: Path) -> None:
    out = tmp_path / "minibatch.json"
    _run(OPTIMIZER_DEFAULTS, "minibatch", "--quick", "--out", str(out))
    rows = json.loads(out.read_text())
    assert [(r["problem"], r["batch"]) for r in rows] == [
        ("regression", 32),
        ("regression", 64),
        ("moons", 32),
        ("moons", 64),
    ]
    for r in rows:
        assert r["cpu_s_per_step"] > 0 and r["noise"] >= 0 and r["gap_ratio"] > 0


@pytest.mark.slow
def test_profile_engine_prints_the_operator_table() -> None:
    text = _run(PROFILE_ENGINE, "--config", "mlp,16,2,4", "--reps", "1")
    assert "Self CPU" in text


@pytest.mark.slow
def test_small_ntk_calls_times_every_step_of_this_tree(tmp_path: Path) -> None:
    out = tmp_path / "calls.md"
    _run(
        SMALL_NTK_CALLS,
        "--trees",
        ".",
        "--rounds",
        "1",
        "--calls",
        "16",
        "--out",
        str(out),
    )
    record = json.loads(out.with_suffix(".json").read_text())
    (tree,) = record["trees"]
    assert len(tree["us"]) == 5 and all(t > 0 for t in tree["us"].values())
    assert "B = 320, no gradient" in out.read_text()


@pytest.mark.slow
def test_route_costs_counts_times_and_fits_both_routes(tmp_path: Path) -> None:
    out, report = tmp_path / "costs.json", tmp_path / "COSTS.md"
    _run(ROUTE_COSTS, "--quick", "--out", str(out), "--markdown", str(report))
    record = json.loads(out.read_text())
    assert len(record["rows"]) == 6  # three cases at B = 1 and 4
    for row in record["rows"]:
        for route in ("factors", "jacobians"):
            assert row[route]["seconds"] > 0 and row[route]["kernels"] > 0
        # forming J is more multiply-adds than the factors' Gram, counted
        assert row["jacobians"]["madds"] > row["factors"]["madds"] > 0
    fitted = record["fitted"]
    assert all(v >= 0 for v in fitted.values())
    assert "| the package's (`device_costs`) |" in report.read_text()
    again = tmp_path / "AGAIN.md"
    _run(ROUTE_COSTS, "--report-from", str(out), "--markdown", str(again))
    assert again.read_text() == report.read_text()
