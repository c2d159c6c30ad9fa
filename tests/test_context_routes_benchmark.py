"""``benchmarks/context_posterior/context_routes.py`` in its quick mode: both
routes of the context posterior, and both of ``LocationFunctionalLaplace``'s
prediction, run in their own processes and agree (predictive mean, variance and
evidence).

No timing is asserted: quick-mode timings are single cold runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_context_routes_run_and_agree(tmp_path: Path) -> None:
    out = tmp_path / "context_routes.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/context_posterior/context_routes.py", "--quick"]
        + ["--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert set(results["routes"]) == {
        "factors", "jacobians", "functional-factors", "functional-jacobians"
    }  # fmt: skip
    for row in results["routes"].values():
        assert row["fit_s"] > 0 and row["predict_s"] > 0
    # the outputs are float32 (the model's dtype); the sums are float64
    for key in (
        "max relative difference, factors vs jacobians",
        "LocationFunctionalLaplace, max relative difference",
    ):
        for difference in results[key].values():
            assert difference < 1e-5
