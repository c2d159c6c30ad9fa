"""Streaming keeps peak memory flat in N (each N measured in a fresh process).

The inputs come from an IterableDataset that generates them batch by batch
(``benchmarks/scaling/scaling.py``'s ``Generated``), so they are never materialised.
For the optimiser and for ``ContextPosterior.fit`` the work's peak resident
memory above the RSS just before it (imports excluded, ``/proc`` high-water
mark reset) at N = 200k stays within 10% (+ 8 MiB of allocator slack) of that
at N = 20k. The CNN's inputs are 64 floats, so holding all 200k of them would
add 49 MiB and its Jacobians 141 MiB: either would fail the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/scaling/scaling.py"


def _peak_increment_mib(job: str, n: int) -> float:
    cfg = dict(model="cnn", n=n, m=16, world=1, steps=3, job=job)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--worker"] + [json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["peak_inc_mib"])


@pytest.mark.slow
@pytest.mark.parametrize("job", ["optimize", "fit"])
def test_streamed_peak_memory_is_flat_in_n(job: str) -> None:
    small = _peak_increment_mib(job, 20_000)
    large = _peak_increment_mib(job, 200_000)
    assert small > 0
    assert large < 1.10 * small + 8.0, (small, large)
