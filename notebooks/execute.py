"""Execute the example notebooks with the current interpreter.

Run from anywhere to refresh the committed outputs (full size, in place)::

    python notebooks/execute.py                 # all notebooks
    python notebooks/execute.py 02_*.ipynb      # some of them
    python notebooks/execute.py --smoke --no-write   # quick check, nothing written

The kernel is always ``sys.executable`` (a kernelspec written to a temporary
directory), so the notebooks run against whatever environment runs this script,
whatever kernels are installed elsewhere. ``tests/test_notebooks.py`` uses the same
functions with ``LAPLACE_DIFFJAC_SMOKE=1``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent
KERNEL_NAME = "laplace-diffjac-current-python"
SMOKE_VARIABLE = "LAPLACE_DIFFJAC_SMOKE"
#: The kernelspec stored in committed notebooks (a neutral, standard one).
STORED_KERNELSPEC = {
    "display_name": "Python 3",
    "language": "python",
    "name": "python3",
}


def notebooks() -> list[Path]:
    """All example notebooks, in order."""
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def current_interpreter_kernel() -> Iterator[str]:
    """Make a kernelspec that runs ``sys.executable`` findable; yield its name.

    The spec lives in a temporary directory put first on ``JUPYTER_PATH`` while the
    context is active; nothing is installed anywhere.
    """
    with tempfile.TemporaryDirectory() as tmp:
        spec_dir = Path(tmp, "kernels", KERNEL_NAME)
        spec_dir.mkdir(parents=True)
        spec = {
            "argv": [
                sys.executable,
                "-m",
                "ipykernel_launcher",
                "-f",
                "{connection_file}",
            ],
            "display_name": f"Python ({sys.executable})",
            "language": "python",
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        old_path = os.environ.get("JUPYTER_PATH")
        path = tmp if old_path is None else os.pathsep.join([tmp, old_path])
        with _environment(JUPYTER_PATH=path, JUPYTER_PLATFORM_DIRS="1"):
            yield KERNEL_NAME


def execute(
    path: Path, *, smoke: bool, timeout: int, kernel_name: str
) -> tuple[nbformat.NotebookNode, float]:
    """Execute one notebook in its own directory; return it with outputs, and seconds.

    Raises ``nbclient.exceptions.CellExecutionError`` if a cell fails (an assertion in
    the notebook included) and ``TimeoutError`` if a cell runs past ``timeout``.
    """
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=kernel_name,
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    with _environment(**{SMOKE_VARIABLE: "1" if smoke else "0"}):
        client.execute()
    seconds = time.perf_counter() - start
    nb.metadata["kernelspec"] = dict(STORED_KERNELSPEC)
    return nb, seconds


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: all")
    parser.add_argument("--smoke", action="store_true", help=f"set {SMOKE_VARIABLE}=1")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument(
        "--no-write", action="store_true", help="execute only, keep files unchanged"
    )
    args = parser.parse_args(argv)
    paths = [p if p.exists() else NOTEBOOK_DIR / p for p in args.notebooks]
    paths = paths or notebooks()
    with current_interpreter_kernel() as kernel_name:
        for path in paths:
            nb, seconds = execute(
                path, smoke=args.smoke, timeout=args.timeout, kernel_name=kernel_name
            )
            if not args.no_write:
                nbformat.write(nb, path)
            print(f"{path.name}: {seconds:.1f} s{'' if args.no_write else ', written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
