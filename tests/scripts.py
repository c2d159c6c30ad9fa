"""Scripts of the repository (benchmarks): imported as modules, or run, by the tests."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """The script at ``path`` as the module ``name``, loaded once.

    It is registered in ``sys.modules`` before it runs, so that its dataclasses
    can look their module up.
    """
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path} as a module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


ROOT = Path(__file__).resolve().parents[1]


def run_script(path: Path, *args: str, timeout: float = 600) -> str:
    """Run the script at ``path`` with this interpreter from the repository root.

    Fails the test, with the tail of the script's stderr, if it exits non-zero.

    Returns
    -------
    str
        The script's stdout.
    """
    proc = subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
