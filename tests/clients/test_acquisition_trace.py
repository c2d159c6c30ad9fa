"""benchmarks/bayesopt/acquisition_trace.py traces one acquisition in quick mode.

No timing is asserted: every traced evaluation is one of the optimiser's (with a
gradient), the best value seen never decreases, the restarts still running never
increase, and the trace's evaluations and the posterior-call count agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import ROOT, run_script

pytest.importorskip("laplace_bayesopt")
pytest.importorskip("botorch")

SCRIPT = ROOT / "benchmarks/bayesopt/acquisition_trace.py"


@pytest.mark.slow
def test_quick_trace_records_every_optimiser_evaluation(tmp_path: Path) -> None:
    methods = ["ContextBoTorch(factors)", "LaplaceBoTorch"]
    run_script(SCRIPT, "--quick", "--out", str(tmp_path), "--methods", *methods)
    records = json.loads((tmp_path / "acquisition_trace.json").read_text())["records"]
    assert [r["method"] for r in records] == methods
    for r in records:
        n = len(r["best"])
        assert n == len(r["active"]) == len(r["faces"]) > 0
        calls = r["calls"]
        assert n == calls["calls"] - calls["scoring_calls"]
        assert all(a >= b for a, b in zip(r["best"][1:], r["best"]))
        assert all(a >= b for a, b in zip(r["active"], r["active"][1:]))
        assert all(0 <= f <= 1 for f in r["faces"])
    report = (tmp_path / "ACQUISITION_TRACE.md").read_text()
    assert all(f"| {m} |" in report for m in methods)
