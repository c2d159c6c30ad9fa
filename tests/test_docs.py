"""The documentation: every code block is run or says why not, every public name has
an API entry, and the README stays a landing page."""

from __future__ import annotations

import importlib
import pkgutil
import re
from types import ModuleType

import pytest
import torch

import laplace_diffjac
from tests.docs import DOCS, README, ROOT, block, fenced_blocks, page, pages

#: Lines the README may have as a landing page.
MAX_README_LINES = 250


def _test_sources() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_block_is_run_by_a_test_or_says_why_not(path):
    sources = _test_sources()
    for found in fenced_blocks(path):
        where = f"{path.relative_to(ROOT)}:{found.line}"
        if found.not_run_reason is not None:
            assert found.not_run_reason.strip(), f"{where}: not-run without a reason"
            continue
        assert found.marker, f"{where}: a block with neither a marker nor not-run"
        assert block(found.marker, path)  # closed by <!-- /marker -->
        assert f'"{found.marker}"' in sources, f"{where}: no test runs {found.marker}"


def test_flavours_example_builds_a_functional_laplace_on_our_backend():
    from laplace import FunctionalLaplace

    from laplace_diffjac import DiffBackPackGGN

    model = torch.nn.Sequential(
        torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )
    namespace = {"model": model}
    code = block("docs-flavours", page("flavours.md"))
    exec(compile(code, "flavours.md", "exec"), namespace)  # noqa: S102
    la = namespace["la"]
    assert isinstance(la, FunctionalLaplace)
    assert isinstance(la.backend, DiffBackPackGGN)


def test_patch_laplace_example_patches_only_inside_the_block():
    from laplace_diffjac.laplace_integration import is_patched

    namespace = {"laplace_diffjac": laplace_diffjac}
    code = block("docs-patch-laplace", page("flavours.md"))
    exec(compile(code, "flavours.md", "exec"), namespace)  # noqa: S102
    assert not is_patched()


def _public_modules() -> list[ModuleType]:
    """``laplace_diffjac``, every subpackage and every top-level module with an
    ``__all__`` (``laplace_diffjac.memory``), none with a leading underscore."""
    modules = [laplace_diffjac]
    for info in pkgutil.walk_packages(
        laplace_diffjac.__path__, prefix="laplace_diffjac."
    ):
        parts = info.name.split(".")
        if any(part.startswith("_") for part in parts):
            continue
        if info.ispkg:
            modules.append(importlib.import_module(info.name))
        elif len(parts) == 2:
            module = importlib.import_module(info.name)
            if hasattr(module, "__all__"):
                modules.append(module)
    return modules


def _resolve(path: str) -> object:
    """The object an mkdocstrings identifier such as ``pkg.module.name`` names."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise AssertionError(f"{path} names no module")


def _documented() -> list[object]:
    """The objects of every ``::: identifier`` directive of the API pages."""
    directives = []
    for path in sorted((DOCS / "api").glob("*.md")):
        directives += re.findall(r"^::: (\S+)$", path.read_text(), re.M)
    assert directives
    return [_resolve(identifier) for identifier in directives]


def test_api_pages_document_every_public_name():
    pytest.importorskip("botorch")  # laplace_diffjac.bayesopt
    documented = _documented()
    modules = _public_modules()
    assert {
        "laplace_diffjac.bayesopt",
        "laplace_diffjac.budget",
        "laplace_diffjac.kernels",
        "laplace_diffjac.memory",
    } <= {m.__name__ for m in modules}
    for module in modules:
        for name in module.__all__:
            obj = getattr(module, name)
            assert any(obj is entry for entry in documented), (
                f"{module.__name__}.{name} has no entry in docs/api"
            )


def test_readme_is_a_landing_page_with_a_map_of_the_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    nav = (ROOT / "mkdocs.yml").read_text()
    for path in sorted(DOCS.rglob("*.md")):
        relative = path.relative_to(DOCS).as_posix()
        assert relative in nav, f"mkdocs.yml's nav lacks {relative}"
        if relative != "index.md" and not relative.startswith("api/"):
            assert f"(docs/{relative})" in text, f"README's map lacks {relative}"
    # the notebooks live at the top level; notebooks/site_hook.py adds them
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) == 4
    for path in [ROOT / "notebooks" / "README.md", *notebooks]:
        assert path.relative_to(ROOT).as_posix() in nav
    assert "(notebooks/README.md)" in text
    assert not (DOCS / "notebooks").exists()
