"""Streaming keeps peak memory flat in N (each N measured in a fresh process).

The inputs come from an IterableDataset generating them batch by batch
(``benchmarks/scaling.py``'s ``Generated``), so they are never materialised;
max RSS of a process optimising with N = 200k exceeds that with N = 20k by
less than 10%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _max_rss_mib(n: int) -> float:
    cfg = dict(model="mlp", n=n, m=16, world=1, steps=3, fit=False)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--worker"]
        + [json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["rss_mib"])


@pytest.mark.slow
def test_streamed_peak_memory_is_flat_in_n():
    small, large = _max_rss_mib(20_000), _max_rss_mib(200_000)
    assert large < 1.10 * small, (small, large)
