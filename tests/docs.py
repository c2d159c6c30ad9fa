"""The README's and the documentation pages' marked blocks, for the tests that run them.

A fenced block is marked by an HTML comment pair around it, ``<!-- name -->`` before
and ``<!-- /name -->`` after, and a test runs it by that name; or it is preceded by
``<!-- not-run: reason -->`` and no test runs it (``tests/test_docs.py`` checks that
every block is one or the other).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```")
_OPEN = re.compile(r"^<!-- ([\w-]+) -->$")
_NOT_RUN = re.compile(r"^<!-- not-run: (.+?) -->$")


@dataclass(frozen=True)
class Block:
    """A fenced block of a page: where it starts and how it is marked."""

    page: Path
    line: int
    marker: str | None
    not_run_reason: str | None


def pages() -> list[Path]:
    """The README and every Markdown page of the documentation."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def page(name: str) -> Path:
    """The documentation page ``docs/<name>``."""
    path = DOCS / name
    assert path.is_file(), f"no documentation page {name}"
    return path


def block(marker: str, path: Path = README) -> str:
    """The fenced block between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    match = re.search(
        rf"<!-- {marker} -->\s*```(?:python|bash)?\n(.*?)```\s*<!-- /{marker} -->",
        path.read_text(),
        re.S,
    )
    assert match, f"{path.name} has no {marker} block"
    return match.group(1)


def readme_block(marker: str) -> str:
    """The README's fenced block between the ``marker`` comments."""
    return block(marker, README)


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, with the marker comment just before it."""
    lines = path.read_text().splitlines()
    blocks = []
    inside = False
    for i, line in enumerate(lines):
        if not _FENCE.match(line):
            continue
        if not inside:
            before = lines[i - 1].strip() if i else ""
            opened = _OPEN.match(before)
            not_run = _NOT_RUN.match(before)
            blocks.append(
                Block(
                    path,
                    i + 1,
                    opened.group(1) if opened else None,
                    not_run.group(1) if not_run else None,
                )
            )
        inside = not inside
    return blocks
