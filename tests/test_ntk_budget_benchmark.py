"""``benchmarks/jacobians/ntk_budget.py`` in its quick mode: every row runs in its
own process, the small budget chunks, and every row's Gram and gradient equal the
unbudgeted factor route's. No timing is asserted: quick timings are single cold runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import ROOT, run_script

SCRIPT = ROOT / "benchmarks/jacobians/ntk_budget.py"


@pytest.mark.slow
def test_quick_ntk_budget_rows_run_and_agree(tmp_path: Path) -> None:
    out, md = tmp_path / "b.json", tmp_path / "B.md"
    run_script(
        SCRIPT, "--quick", "--batch", "8", "--out", str(out), "--markdown", str(md)
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["route"], r["budget"]) for r in rows] == [
        (route, budget)
        for route, small in (("factors", "320 KiB"), ("jacobians", "960 KiB"))
        for budget in ("default", small, "none")
    ]
    for row in rows:
        assert "error" not in row, row
        assert row["seconds"] > 0 and row["rel_diff"] < 1e-5  # float32 model
    text = md.read_text()
    assert "| B | route | budget | s | peak GiB | × none | GFLOP | GFLOP/s |" in text
    assert all(r["gflop"] > 0 for r in rows)
