"""benchmarks/scaling/scaling.py runs in quick mode (1 process and 2 gloo ranks).

No timing is asserted: quick-mode timings are single cold runs.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/scaling/scaling.py"


@pytest.mark.slow
def test_quick_scaling_benchmark_writes_table_and_plot(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"] + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [
        line.split("|")[1:-1]
        for line in (tmp_path / "SCALING.md").read_text().splitlines()
        if line.startswith("| optimize") or line.startswith("| fit")
    ]
    cells = [[c.strip() for c in r] for r in rows]
    assert [(r[0], r[1], r[4]) for r in cells] == [
        ("optimize", "mlp", "1"),
        ("fit", "cnn", "2"),
    ]
    optimize, fit = cells
    assert float(optimize[5]) > 0 and float(optimize[6]) > 0 and optimize[7] == "–"
    assert fit[5] == "–" and float(fit[7]) > 0
    for r in cells:
        peak, rss = float(r[8]), float(r[9])
        assert math.isfinite(peak) and 0 < peak < rss
    assert (tmp_path / "scaling.png").stat().st_size > 1000
