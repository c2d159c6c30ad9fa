"""The package's public surface and the shape of its tree."""

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
    "data",
    "context",
    "laplace_integration",
    "bayesopt",
    "examples",
]

#: Documented public names of each subpackage (docs/design.md, docs/api).
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
        "LocationFunctionalLaplace",
    ],
    "laplace_diffjac.data": ["TrainingData", "Data", "all_reduce_sum"],
    "laplace_diffjac.kernels": [
        "ntk",
        "ntk_diag",
        "structured_ntk",
        "output_hessians",
        "jittered_cholesky",
    ],
    "laplace_diffjac.context": [
        "ContextPosterior",
        "optimize_locations",
        "nystrom_gap",
        "LocationResult",
        "LocationSettings",
    ],
    "laplace_diffjac.context.locations": ["optimize_locations", "LocationSettings"],
    "laplace_diffjac.context.posterior": ["ContextPosterior", "evidence_loss_backward"],
    "laplace_diffjac.bayesopt": ["ContextBoTorch", "RetrainSchedule"],
    "laplace_diffjac.examples": ["make_moons", "train_mlp", "run_demo"],
    "laplace_diffjac.examples.plotting": ["plot"],
    "laplace_diffjac.budget": [
        "set_memory_budget",
        "memory_budget",
        "get_memory_budget",
        "MemoryBudgetError",
    ],
    "laplace_diffjac.memory": [
        "keep_freed_memory",
        "start_keeping_freed_memory",
        "stop_keeping_freed_memory",
        "can_keep_freed_memory",
    ],
}

MAX_FUNCTION_LINES = 60
#: A warning sign, not a design: modules are split by responsibility, and a
#: cohesive class (``ContextPosterior``) may be longer than a cut one would be.
MAX_MODULE_LINES = 800

#: The only folders that may import laplace-torch (examples aside).
LAPLACE_TORCH_LAYERS = {"backends", "laplace_integration", "examples"}


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


def test_names_removed_from_context_say_where_they_are():
    """The 0.1.0 aliases are gone from ``context`` (the layer below them)."""
    from laplace_diffjac import context, laplace_integration

    for name in ("LocationFunctionalLaplace", "functional_laplace_on_locations"):
        with pytest.raises(AttributeError, match=f"laplace_integration.+{name}"):
            getattr(context, name)
        assert getattr(laplace_diffjac, name) is getattr(laplace_integration, name)
    with pytest.raises(AttributeError, match="no attribute"):
        context.not_a_name  # noqa: B018


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
        elif isinstance(node, (ast.Import, ast.ImportFrom)):  # absolute
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            for name in names:
                parts = name.split(".")
                if parts[0] == "laplace_diffjac" and len(parts) > 1:
                    if parts[1] in LAYERS:
                        found.add(parts[1])
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


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _internal_imports(path: pathlib.Path) -> set[str]:
    """Modules of the package ``path`` imports, ``TYPE_CHECKING`` blocks included."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            while name and name.split(".")[0] == "laplace_diffjac":
                if name in MODULES:
                    found.add(name)
                    break
                name = name.rsplit(".", 1)[0] if "." in name else ""
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_import_cycles():
    """No module reaches itself through imports, ``TYPE_CHECKING`` included.

    A package's ``__init__`` re-exporting its modules is not a cycle of a module
    with its package: a module importing its own package's ``__init__`` is.
    """
    graph = {name: _internal_imports(path) for name, path in MODULES.items()}
    for name in graph:  # a module's own package __init__ importing it is fine
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle.extend([*stack[stack.index(nxt) :], nxt])
                return True
            if state.get(nxt) is None and visit(nxt, [*stack, nxt]):
                return True
        state[node] = 2
        return False

    for name in sorted(graph):
        if state.get(name) is None and visit(name, [name]):
            break
    assert not cycle, " -> ".join(cycle)


def test_context_posterior_never_imports_the_optimiser():
    """``context.locations`` may use ``context.posterior``, never the reverse."""
    for name, path in MODULES.items():
        if name.startswith("laplace_diffjac.context.posterior"):
            for target in _internal_imports(path):
                assert not target.startswith("laplace_diffjac.context.locations"), (
                    name,
                    target,
                )


def _absolute_imports(path: pathlib.Path) -> set[str]:
    """Top-level names of every absolute import in ``path``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add((node.module or "").split(".")[0])
    return names


@pytest.mark.parametrize(
    ("distributions", "layers"),
    [
        ({"laplace"}, LAPLACE_TORCH_LAYERS),
        # The package imports without the bayesopt extra.
        ({"botorch", "gpytorch", "linear_operator"}, {"bayesopt"}),
    ],
)
def test_optional_dependencies_only_in_their_layers(distributions, layers):
    for path in _modules():
        if path.relative_to(PACKAGE).parts[0] in layers:
            continue
        assert not _absolute_imports(path) & distributions, path


def test_test_modules_import_no_sibling_test_module():
    """Shared test code lives in conftest, helpers or reference modules."""
    tests = pathlib.Path(__file__).parent
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                leaf = module.split(".")[-1]
                assert not leaf.startswith("test_"), (str(path), module)
