"""laplace-torch imported once, without the one warning its import prints.

laplace-torch imports its ASDL backend at import time, and ASDL decorates
functions with ``torch.jit.script``, which torch (2.10 and later) deprecates with a
``FutureWarning`` on every such call: five lines on stderr at every
``import laplace_diffjac``, none of them about this package or anything a user can
change. This module imports laplace-torch first, with that warning alone silenced
(by its message, category and the module that issues it) and only around that
import; every other warning, and that same warning from any later call, stays as
the user's filters say. ``backends/__init__.py`` imports this module before any
module that imports laplace-torch.
"""

from __future__ import annotations

import warnings

__all__: list[str] = []

with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.jit\.script` is deprecated",
        category=FutureWarning,
        module=r"torch\.jit\._script",
    )
    import laplace  # noqa: F401
