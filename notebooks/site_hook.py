"""mkdocs hook: the site renders the notebooks from this folder.

The notebooks live at the repository's top level (``notebooks/``, beside the
package, the tests and the README), where a user who clones the repository looks
for them, not inside mkdocs' ``docs_dir``. This hook adds them and this folder's
``README.md`` (the site's ``notebooks/`` index page) to the site's files under
``notebooks/``, before mkdocs-jupyter turns the notebooks into pages, and has
``mkdocs serve`` watch the folder. ``mkdocs.yml`` names it under ``hooks``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

NOTEBOOKS = Path(__file__).resolve().parent
ROOT = NOTEBOOKS.parent


def site_sources() -> list[Path]:
    """The folder's files that become pages: its README and the notebooks."""
    return [NOTEBOOKS / "README.md", *sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))]


@event_priority(100)  # before mkdocs-jupyter (priority 0) wraps the notebooks
def on_files(files: Files, config: Any) -> Files:
    """Add the notebooks and the README to the site, under ``notebooks/``."""
    for path in site_sources():
        files.append(
            File(
                path.relative_to(ROOT).as_posix(),
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    """Rebuild when a notebook changes under ``mkdocs serve``."""
    server.watch(str(NOTEBOOKS))
    return server
