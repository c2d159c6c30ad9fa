"""benchmarks/scaling/distributed_fit.py in quick mode (1 process and 2 gloo ranks).

No timing is asserted: quick-mode timings are single cold runs. The two rows must
agree on the data set size and the evidence (the ranks fit the union of shards).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/scaling/distributed_fit.py"


@pytest.mark.slow
def test_quick_distributed_fit_benchmark_writes_table(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"] + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "distributed_fit.json").read_text())
    assert [r["world"] for r in rows] == [1, 2]
    assert [r["n_data"] for r in rows] == [600, 600]
    assert math.isclose(rows[0]["lml"], rows[1]["lml"], rel_tol=1e-10)
    for r in rows:
        assert r["fit_s"] > 0 and 0 < r["peak_inc_mib"] < r["rss_mib"]
    table = (tmp_path / "DISTRIBUTED_FIT.md").read_text()
    assert table.count("| all x kron | 600 |") == 2
