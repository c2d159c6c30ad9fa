"""One benchmark row in a fresh interpreter.

A row run in its own process has its own peak memory and its own clock, and its
failure (an exception, a crash, a timeout) is a row of the table rather than the
end of the run. Used by ``ntk_budget.py`` beside it and by the budget and route
benchmarks of other topics, which put this folder on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_worker(
    script: Path,
    cfg: dict,
    timeout: float,
    keys: Iterable[str] | None = None,
    extra_args: Sequence[str] = (),
) -> dict:
    """``script --worker JSON(cfg) *extra_args`` in a new interpreter; its row.

    Parameters
    ----------
    script : Path
        The benchmark; its ``--worker`` mode prints the row as JSON, last line.
    cfg : dict
        The row's settings, ``threads`` among them (OpenMP's and MKL's threads).
    timeout : float
        Seconds before the process is killed.
    keys : iterable of str, optional
        The settings a failed row keeps (default: all of ``cfg``).
    extra_args : sequence of str
        Further arguments of the worker.

    Returns
    -------
    dict
        The worker's row, or the settings with ``error``: the timeout, or the
        exit status and the last line of the worker's standard error.

    """
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]))
    env["MKL_NUM_THREADS"] = str(cfg["threads"])
    cmd = [sys.executable, str(script), "--worker", json.dumps(cfg), *extra_args]
    row = dict(cfg) if keys is None else {k: cfg[k] for k in keys}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return dict(row, error=f"timeout: past {timeout:.0f} s")
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [""])[-1]
        return dict(row, error=f"process exited {proc.returncode}: {tail}"[:300])
    return json.loads(proc.stdout.strip().splitlines()[-1])
