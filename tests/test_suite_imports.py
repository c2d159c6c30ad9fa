"""The package's tests need nothing but the ``test`` extra.

Every module the tests import at top level is the standard library's, this
checkout's (``laplace_diffjac``, ``tests``, the benchmark harness's ``run``), a
distribution that the package or its ``test`` extra requires, or one the module
first asks for with ``pytest.importorskip`` (``tests/clients``: the ``clients``
extra). The real-data study (``studies/``, its own extra) is never imported.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
LOCAL = {"laplace_diffjac", "tests", "run"}  # run: benchmarks/jacobians/run.py


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement)[0]).lower()


def _required(extras: set[str]) -> set[str]:
    """Distributions laplace-diffjac requires with ``extras`` (followed through)."""
    found, todo = set(), set(extras)
    while todo:
        extra = todo.pop()
        for req in metadata.requires("laplace-diffjac") or []:
            marker = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", req)
            if (marker[1] if marker else "") != extra:
                continue
            name = _name(req)
            if name == "laplace-diffjac":
                todo |= set(re.search(r"\[(.*)\]", req)[1].split(",")) - extras
                extras |= todo
            else:
                found.add(name)
    return found


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - {"__future__"}


def _asked_for(path: Path) -> set[str]:
    """Modules ``path`` hands to ``pytest.importorskip`` (skipped without them)."""
    return {
        node.args[0].value.split(".")[0]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "importorskip"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names")
def test_every_import_of_the_tests_is_in_the_test_extra():
    providers = metadata.packages_distributions()
    allowed = _required({"", "test"})
    outside = []
    for path in sorted(TESTS.rglob("*.py")):
        for name in _top_level_imports(path) - _asked_for(path):
            if name in sys.stdlib_module_names or name in LOCAL:
                continue
            dists = {_name(d) for d in providers.get(name, [])}
            if not dists & allowed:
                outside.append(f"{path.relative_to(TESTS)}: {name} ({dists or '?'})")
    assert not outside, "\n".join(outside)


def test_the_tests_never_import_the_study():
    users = [
        str(path.relative_to(TESTS))
        for path in sorted(TESTS.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(
            n.split(".")[0] == "studies" or n.startswith("benchmarks.real")
            for n in (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
        )
    ]
    assert not users
