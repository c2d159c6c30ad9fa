"""``benchmarks/context_posterior/context_budget.py`` in its quick mode: every row
runs in its own process, small budgets chunk the fit (recomputing or holding the
locations) and the location step, a budget too small for a step is refused, and
every row's predictive variance and evidence, or locations after three steps,
equal the unbudgeted row's. No timing is
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
    budgets = ("none", "640 KiB", "2.25 MiB")
    run_script(SCRIPT, "--quick", "--budgets", *budgets, "--out", str(out))
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert [(r["path"], r["budget"]) for r in rows] == [
        (path, budget) for path in ("fit", "step") for budget in budgets
    ]
    fits, steps = rows[:3], rows[3:]
    for row in fits:
        assert "error" not in row, row
        assert row["fit_s"] > 0 and row["rel_diff"] < 1e-10
        assert row["fit_gflop"] > 0  # counted on one more, untimed fit
    assert fits[0]["plan"] == "whole"
    assert fits[1]["plan"].endswith("(recomputed)"), fits[1]
    assert fits[2]["plan"].endswith("(held)"), fits[2]
    assert steps[1]["error"].startswith("MemoryBudgetError: A location step")
    for row in (steps[0], steps[2]):
        assert "error" not in row, row
        # the model is float32, and so are the locations' gradients: the blocked
        # backward pass adds them in another order (float64 steps: test_budgeted_step)
        assert row["step_s"] > 0 and row["rel_diff"] < 1e-5
        assert row["total_gflop"] > 0
    assert steps[0]["plan"] == "whole"
    assert steps[2]["plan"].startswith("locations in blocks of"), steps[2]
    assert results["floor"]["flops_per_s"] > 0
