"""``benchmarks/context_posterior/context_budget.py`` in its quick mode: every row
runs in its own process, the small budget chunks the fit, and every row's
predictive variance and evidence equal the unbudgeted row's. No timing is
asserted: quick timings are single cold runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import ROOT, run_script

SCRIPT = ROOT / "benchmarks/context_posterior/context_budget.py"


@pytest.mark.slow
def test_quick_context_budget_rows_run_chunk_and_agree(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    budgets = ("none", "default", "160 KiB")
    run_script(SCRIPT, "--quick", "--budgets", *budgets, "--out", str(out))
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert [r["budget"] for r in rows] == list(budgets)
    for row in rows:
        assert "error" not in row, row
        assert row["fit_s"] > 0 and row["rel_diff"] < 1e-10
    assert rows[0]["plan"] == "whole"
    assert rows[2]["plan"].startswith("chunks of"), rows[2]
    assert results["floor"]["flops_per_s"] > 0
