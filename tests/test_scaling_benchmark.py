"""benchmarks/scaling.py runs in quick mode (1 process and 2 gloo ranks).

No timing is asserted: quick-mode timings are single cold runs.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_scaling_benchmark_writes_table_and_plot(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--quick"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [
        line.split("|")[1:-1]
        for line in (tmp_path / "SCALING.md").read_text().splitlines()
        if line.startswith("| mlp") or line.startswith("| cnn")
    ]
    assert [(r[0].strip(), r[3].strip()) for r in rows] == [("mlp", "1"), ("cnn", "2")]
    for r in rows:
        step, fit, rss = float(r[4]), float(r[6]), float(r[7])
        assert step > 0 and math.isfinite(fit) and fit > 0 and rss > 0
    assert (tmp_path / "scaling.png").stat().st_size > 1000
