"""laplace-torch imported once, without the warnings its import prints.

laplace-torch imports its ASDL backend at import time, and ASDL decorates
functions with ``torch.jit.script``, which torch (2.10 and later) deprecates with a
``FutureWarning`` on every such call: five lines on stderr at every
``import laplace_diffjac``, none of them about this package or anything a user can
change. In a Jupyter kernel without ipywidgets, the same import (through
``huggingface_hub``'s ``tqdm.auto``) also prints tqdm's "IProgress not found"
``TqdmWarning`` (issued in ``tqdm.autonotebook``, attributed to ``tqdm.auto``).
This module imports laplace-torch first, with those two warnings alone silenced
(each by its message, category and the module it is attributed to) and only
around that import; every other warning, and the same warnings from any later
call, stay as the user's filters say. ``backends/__init__.py`` imports this module
before any module that imports laplace-torch.
"""

from __future__ import annotations

import warnings

from tqdm import TqdmWarning

__all__: list[str] = []

with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.jit\.script` is deprecated",
        category=FutureWarning,
        module=r"torch\.jit\._script",
    )
    warnings.filterwarnings(
        "ignore",
        message="IProgress not found",
        category=TqdmWarning,
        module=r"tqdm\.auto(notebook)?",
    )
    import laplace  # noqa: F401
