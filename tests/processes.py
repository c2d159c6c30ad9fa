"""The environment of the Python subprocesses that tests start."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every warning is an error, as in the suite (pyproject's filterwarnings), except the
# import-time notice of a dependency: torch warns when one calls torch.jit.script
# while being imported.
STRICT_WARNINGS = "error,ignore::FutureWarning:torch.jit._script"


def python_env(*ignore: str) -> dict[str, str]:
    """``os.environ`` with this checkout first on the path and warnings as errors.

    ``ignore`` are further ``PYTHONWARNINGS`` entries (``"ignore:message
    start:Category"``), each for a warning the caller names and explains.
    """
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    warnings = ",".join((STRICT_WARNINGS, *ignore))
    return {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": warnings}
