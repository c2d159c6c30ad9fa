"""``benchmarks/jacobians/ntk_routes.py`` in its quick mode: every route runs or says
why not, and every Gram that it times agrees with the per-layer factor route's.

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
    out = tmp_path / "routes.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--repeats", "1"]
        + ["--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert set(results["cases"]) == {"mlp", "cnn", "transformer"}
    for case in results["cases"].values():
        rows = case["routes"]
        # the routes this package owns never fail
        assert "seconds" in rows["factors"] and "seconds" in rows["jacobians"]
        for row in rows.values():
            if "error" in row:
                continue
            assert row["seconds"] > 0
            assert row["max relative difference to factors"] < 1e-4
