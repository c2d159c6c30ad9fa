"""The package's public surface and the shape of its tree: layering and sizes."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import laplace_diffjac

PACKAGE = pathlib.Path(laplace_diffjac.__file__).parent

#: The layers, each importing only the ones before it (and errors, _compat-free).
LAYERS = [
    "jacobians",
    "backends",
    "kernels",
    "context",
    "laplace_integration",
    "examples",
]

#: Documented public names of each subpackage (README's Design section).
SUBPACKAGE_NAMES = {
    "laplace_diffjac.jacobians": ["parameter_jacobians", "last_layer_jacobians"],
    "laplace_diffjac.backends": [
        "DiffBackPackGGN",
        "DiffBackPackEF",
        "DiffFuncGGN",
        "JacobianBackend",
        "as_backend",
    ],
    "laplace_diffjac.laplace_integration": [
        "register",
        "unregister",
        "patch_laplace",
        "LAPLACE_VERSION",
    ],
    "laplace_diffjac.kernels": [
        "ntk",
        "ntk_diag",
        "structured_ntk",
        "output_hessians",
        "jittered_cholesky",
    ],
    "laplace_diffjac.context": [
        "ContextPosterior",
        "LocationFunctionalLaplace",
        "optimize_locations",
        "nystrom_gap",
        "LocationResult",
    ],
    "laplace_diffjac.examples": ["make_moons", "train_mlp", "run_demo"],
    "laplace_diffjac.examples.plotting": ["plot"],
}

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def test_every_name_in_all_imports():
    for name in laplace_diffjac.__all__:
        assert getattr(laplace_diffjac, name) is not None, name
    for module_name in SUBPACKAGE_NAMES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            assert hasattr(module, name), (module_name, name)


@pytest.mark.parametrize("module_name", sorted(SUBPACKAGE_NAMES))
def test_documented_subpackage_paths(module_name):
    module = importlib.import_module(module_name)
    for name in SUBPACKAGE_NAMES[module_name]:
        assert name in module.__all__ and hasattr(module, name), name


def test_top_level_names_are_the_subpackages_objects():
    from laplace_diffjac import context, kernels

    assert laplace_diffjac.ContextPosterior is context.ContextPosterior
    assert laplace_diffjac.ntk is kernels.ntk


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_layers(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    depth = len(path.relative_to(PACKAGE).parts) - 1
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            up = node.level - 1
            parts = list(path.relative_to(PACKAGE).parts[:depth])
            base = parts[: len(parts) - up] if up else parts
            target = base + (node.module.split(".") if node.module else [])
            if target and target[0] in LAYERS:
                found.add(target[0])
            elif not target:  # "from .. import x"
                found.update(a.name for a in node.names if a.name in LAYERS)
    return found


def test_layers_import_only_layers_above_them():
    for path in _modules():
        rel = path.relative_to(PACKAGE).parts
        if len(rel) < 2 or rel[0] not in LAYERS:
            continue
        own = LAYERS.index(rel[0])
        for layer in _imported_layers(path):
            assert LAYERS.index(layer) <= own, (str(path), layer)


def test_the_engine_never_imports_laplace_torch():
    for path in (PACKAGE / "jacobians").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "laplace" for n in names), path


def _function_lengths(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                body = body[1:]  # the docstring does not count
            if body:
                yield node.name, body[-1].end_lineno - body[0].lineno + 1


def test_no_long_functions_or_modules():
    too_long = []
    for path in _modules():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(PACKAGE)}: {lines} lines")
        for name, length in _function_lengths(path):
            if length > MAX_FUNCTION_LINES:
                too_long.append(f"{path.relative_to(PACKAGE)}:{name}: {length} lines")
    assert not too_long, "\n".join(too_long)


def test_only_the_plotting_module_imports_matplotlib():
    """matplotlib is the ``plot`` extra: no other module of ours may need it."""
    users = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            if any(n.split(".")[0] == "matplotlib" for n in names):
                users.add(path.relative_to(PACKAGE).as_posix())
    assert users == {"examples/plotting.py"}
