"""benchmarks/bayesopt/posterior_calls.py runs in quick mode and reports every row.

No timing is asserted beyond being positive: each function and batch size has an
acquisition and a posterior row for the three methods, and the two
``ContextBoTorch`` routes (Linear layers' and Jacobians) agree to rounding on the
same acquisition object.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import ROOT, run_script

pytest.importorskip("laplace_bayesopt")
pytest.importorskip("botorch")


@pytest.mark.slow
def test_quick_posterior_calls_times_every_method_and_the_routes_agree(
    tmp_path: Path,
) -> None:
    out = tmp_path / "CALLS.md"
    run_script(
        ROOT / "benchmarks/bayesopt/posterior_calls.py", "--quick", "--out", str(out)
    )
    record = json.loads(out.with_suffix(".json").read_text())
    assert [(r["function"], r["q"]) for r in record["rows"]] == [
        ("branin", 1),
        ("branin", 2),
    ]
    for row in record["rows"]:
        assert row["routes_differ_by"]["posterior"] < 1e-10
        assert row["routes_differ_by"]["acquisition"] < 1e-8  # log-EI's cancellation
        for method in (
            "ContextBoTorch",
            "ContextBoTorch, Jacobian route",
            "LaplaceBoTorch",
        ):
            assert all(t > 0 for t in row["seconds"][method].values())
    assert out.read_text().count("| branin |") == 4
