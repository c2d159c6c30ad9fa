"""Constructors of laplace-torch classes, wrapped to rewrite their ``backend``.

laplace-torch passes the curvature backend *class* to every estimator's
constructor (``backend=...``, by keyword, by position or as a default). The
wrappers here read that one argument, whichever way it came, and let a policy
replace it before, or restore it after, the original constructor runs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

#: ``policy(backend) -> (backend to pass on, backend to install afterwards)``;
#: the second is ``None`` when the object's backend class is to be left alone.
BackendPolicy = Callable[[Any], "tuple[Any, Any | None]"]


def wrap_init(original: Callable[..., None], policy: BackendPolicy) -> Callable:
    """Wrap a constructor so ``policy`` decides the ``backend`` it sees.

    Parameters
    ----------
    original : callable
        ``__init__`` of a laplace-torch estimator; it has a ``backend`` parameter.
    policy : BackendPolicy
        Called with the backend class the caller chose (the default if none was
        passed). Returns the class handed to ``original`` and, if not ``None``,
        the class stored as ``self._backend_cls`` once ``original`` returned
        (the lazily built ``self._backend`` is reset with it).

    Returns
    -------
    callable
        The wrapper, with ``original``'s name, docstring and signature; its
        ``backend_policy`` attribute is ``policy`` (so others can ask what a
        backend becomes while the wrapper is installed).

    Raises
    ------
    TypeError
        If ``original`` has no ``backend`` parameter.

    """
    signature = inspect.signature(original)
    if "backend" not in signature.parameters:
        raise TypeError(f"{original.__qualname__} has no `backend` parameter.")
    default = signature.parameters["backend"].default

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        chosen = bound.arguments.get("backend", default)
        passed, installed = policy(chosen)
        if passed is chosen and installed is None:
            original(self, *args, **kwargs)
            return
        bound.arguments["backend"] = passed
        original(*bound.args, **bound.kwargs)
        if installed is not None:
            self._backend_cls = installed
            self._backend = None

    __init__.backend_policy = policy  # type: ignore[attr-defined]
    return __init__


__all__ = ["BackendPolicy", "wrap_init"]
