"""The benchmarks' layout: every script is run by a test or says why not, the index
names every topic and script, and every benchmark path the docs name exists.

A benchmark script is a module of ``benchmarks/`` with an ``if __name__ ==
"__main__"`` block that no script beside it starts (``jacobians/worker.py`` is
started by ``run.py``, which names it); the other modules are helpers, imported
beside them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
INDEX = BENCHMARKS / "README.md"
TOPICS = [
    "jacobians",
    "optimizer",
    "context_posterior",
    "scaling",
    "bayesopt",
    "zoo",
    "curvature",
    "gpu",
]

#: Scripts no test runs, each with the reason.
NOT_RUN = {
    "benchmarks/optimizer/optimizer_speed.py": (
        "its data set is scikit-learn's digits: scikit-learn is the study extra, "
        "which the test extra does not install"
    ),
}


def _is_script(path: Path) -> bool:
    return any(
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        for node in ast.parse(path.read_text()).body
    )


def _modules() -> list[Path]:
    return sorted(BENCHMARKS.rglob("*.py"))


def _started_by_a_sibling(path: Path) -> bool:
    """Whether a module beside ``path`` names its file (and starts it)."""
    quoted = f'"{path.name}"'
    return any(quoted in p.read_text() for p in path.parent.glob("*.py") if p != path)


def _scripts() -> list[str]:
    return [
        p.relative_to(ROOT).as_posix()
        for p in _modules()
        if _is_script(p) and not _started_by_a_sibling(p)
    ]


def _test_sources() -> str:
    here = Path(__file__).resolve()
    return "\n".join(
        p.read_text() for p in sorted((ROOT / "tests").rglob("*.py")) if p != here
    )


def test_benchmarks_live_in_their_topic_folders():
    ignored = {"__pycache__", "out"}  # out: scratch output, in .gitignore
    folders = [p.name for p in BENCHMARKS.iterdir() if p.is_dir()]
    assert sorted(set(folders) - ignored) == sorted(TOPICS)
    loose = [p.name for p in BENCHMARKS.iterdir() if p.is_file()]
    assert loose == ["README.md"], loose
    assert not (BENCHMARKS / "__init__.py").exists()  # scripts, run by path


def test_every_benchmark_script_is_run_by_a_test_or_says_why_not():
    sources = _test_sources()
    scripts = _scripts()
    assert len(scripts) >= len(TOPICS)
    for script in scripts:
        if script in NOT_RUN:
            assert NOT_RUN[script].strip(), script
            assert script not in sources, f"{script} is run: drop it from NOT_RUN"
            continue
        assert script in sources, f"no test runs {script} (or list it in NOT_RUN)"
    assert set(NOT_RUN) <= set(scripts), set(NOT_RUN) - set(scripts)


def _imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def test_every_helper_is_imported_beside_it():
    for helper in _modules():
        if _is_script(helper):
            continue
        folder = [p for p in helper.parent.glob("*.py") if p != helper]
        assert any(helper.stem in _imported_names(p) for p in folder), (
            f"{helper.relative_to(ROOT)}: no module beside it imports it"
        )


def test_benchmarks_never_import_the_tests():
    for path in _modules():
        assert not any(n.split(".")[0] == "tests" for n in _imported_names(path)), path


def test_the_index_names_every_topic_script_and_page():
    text = INDEX.read_text()
    for topic in TOPICS:
        assert f"[`{topic}/`]({topic})" in text, topic
    for script in _scripts():
        assert f"`python {script}" in text, f"the index has no command for {script}"
    for path in _modules():
        assert f"`{path.name}`" in text, f"the index does not name {path.name}"
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        assert (BENCHMARKS / target).resolve().exists(), f"index: {target}"


_PATH = re.compile(r"benchmarks/[\w./-]*[\w/]")


def test_every_benchmark_path_the_docs_and_code_name_exists():
    """Paths in the README, the docs, the package's docstrings and the tests."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "laplace_diffjac").rglob("*.py"))
    files += sorted((ROOT / "tests").rglob("*.py"))
    files += [INDEX, *(p for p in _modules())]
    missing = []
    for path in files:
        for found in _PATH.findall(path.read_text()):
            if not (ROOT / found).exists():
                missing.append(f"{path.relative_to(ROOT)}: {found}")
    assert not missing, "\n".join(missing)


def test_each_topical_page_names_its_benchmark_folder():
    pages = [
        ("speed.md", "jacobians"),
        ("speed.md", "gpu"),
        ("locations.md", "optimizer"),
        ("posterior.md", "context_posterior"),
        ("scaling.md", "scaling"),
        ("bayesopt.md", "bayesopt"),
        ("zoo.md", "zoo"),
    ]
    for page, topic in pages:
        text = (ROOT / "docs" / page).read_text()
        assert f"`benchmarks/{topic}/`" in text, page
        assert "`benchmarks/README.md`" in text, page
