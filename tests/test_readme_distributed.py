"""The scaling page's torchrun example runs on two ranks and fits the shards' union."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs import block, page

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(script: Path, ranks: int) -> list[tuple[int, int, float]]:
    """``(rank, n_data, log evidence)`` printed by each rank, in rank order.

    Each rank's stdout goes to its own file (torchrun's ``--redirects``): on one
    shared pipe the ranks' prints can interleave mid-line.
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    logs = script.parent / f"logs-{ranks}"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + [f"--nproc_per_node={ranks}", f"--log-dir={logs}", "--redirects=1"]
        + [str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=script.parent,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(logs.rglob("stdout.log"))
    assert len(files) == ranks, files
    rows = [line.split() for f in files for line in f.read_text().splitlines()]
    return sorted(
        (int(r), int(n), float(e)) for r, n, e in (x for x in rows if len(x) == 3)
    )


@pytest.mark.slow
def test_readme_torchrun_example_fits_all_points_on_both_ranks(tmp_path: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(block("distributed-fit-example", page("scaling.md")))
    two = _torchrun(script, 2)
    (single,) = _torchrun(script, 1)  # a group of one: laplace-torch unchanged
    assert [(rank, n_data) for rank, n_data, _ in two] == [(0, 1000), (1, 1000)]
    assert two[0][2] == two[1][2]
    # float32 model: the ranks' sums are rounded in another order than one process's.
    assert math.isclose(two[0][2], single[2], rel_tol=1e-5)
    assert single[:2] == (0, 1000)
