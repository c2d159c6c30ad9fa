"""One benchmark configuration measured in a fresh Python process.

Shared by ``scaling.py`` and ``distributed_fit.py``: each row runs in its own
process, so that its max RSS is its own.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

#: The repository root: the fresh process imports this checkout's package.
ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_fresh(script: str, cfg: dict, **env: str) -> dict:
    """``python SCRIPT --worker CFG_JSON`` in a fresh process; its last line's JSON.

    Parameters
    ----------
    script : str
        The benchmark script, which answers ``--worker`` with one JSON line.
    cfg : dict
        The configuration, passed as JSON.
    **env : str
        Further environment variables of the process (``OMP_NUM_THREADS``, ...).

    Returns
    -------
    dict
        The measurement the process printed last.

    """
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    proc = subprocess.run(
        [sys.executable, script, "--worker", json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=environment,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])
