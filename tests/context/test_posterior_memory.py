"""Peak memory of ContextPosterior.fit does not grow with N (streamed inputs)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _peak_mib(n: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "posterior_memory.py"), str(n)],
        capture_output=True, text=True, check=True, env=env, cwd=ROOT,
    ).stdout  # fmt: skip
    match = re.search(rf"N={n} max_rss_mib=([0-9.]+)", out)
    assert match is not None, out
    return float(match.group(1))


@pytest.mark.slow
def test_fit_peak_memory_is_flat_from_20k_to_200k_points():
    small, large = _peak_mib(20_000), _peak_mib(200_000)
    assert large < 1.10 * small, (small, large)
