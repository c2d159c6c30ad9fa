"""Every example notebook runs at smoke size and its closing assertions hold.

The notebooks run in a kernel on the current interpreter (a kernelspec in a temporary
directory, see ``notebooks/execute.py``), so this works in a fresh ``pip install -e
.[test]`` environment. This process checks that every cell, the final assertions
included, succeeds, that the import cell writes nothing to stderr and that no cell
prints the dependency warnings the package keeps out of its import.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

_EXECUTE = Path(__file__).resolve().parents[1] / "notebooks" / "execute.py"
_spec = importlib.util.spec_from_file_location("notebook_execute", _EXECUTE)
assert _spec is not None and _spec.loader is not None
execute_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute_notebooks)

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def kernel_name():
    with execute_notebooks.current_interpreter_kernel() as name:
        yield name


def test_notebooks_are_found():
    names = [p.name for p in execute_notebooks.notebooks()]
    assert names == sorted(names) and len(names) >= 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "path", execute_notebooks.notebooks(), ids=lambda p: p.stem.split("_")[0]
)
def test_notebook_runs_at_smoke_size(path: Path, kernel_name: str) -> None:
    nb, seconds = execute_notebooks.execute(
        path, smoke=True, timeout=TIMEOUT_S, kernel_name=kernel_name
    )
    assert seconds < TIMEOUT_S, f"{path.name} took {seconds:.0f} s"
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors
    # a quiet kernel: the import cell writes nothing to stderr, and no cell prints
    # the dependencies' warnings the package keeps out of its import (notebook 01
    # shows laplace-torch's own BackPACK warnings on purpose)
    stderr = [
        (i, "".join(out["text"]))
        for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code")
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream" and out.get("name") == "stderr"
    ]
    assert not [text for i, text in stderr if i == 0], stderr
    for _, text in stderr:
        assert "TqdmWarning" not in text and "torch.jit.script" not in text, text
