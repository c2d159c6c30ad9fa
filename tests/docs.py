"""The README's marked blocks, for the tests that run or check them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(marker: str) -> str:
    """The fenced block between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    text = README.read_text()
    match = re.search(
        rf"<!-- {marker} -->\s*```(?:python)?\n(.*?)```\s*<!-- /{marker} -->",
        text,
        re.S,
    )
    assert match, f"README has no {marker} block"
    return match.group(1)
