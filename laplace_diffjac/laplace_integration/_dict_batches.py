"""Dict-like batches (``BatchEncoding``) reach this package's BackPACK backends.

laplace-torch's ``ParametricLaplace.fit`` refuses a dict-like first batch for every
backend whose class name contains "backpack" (laplace-torch's BackPACK backends
take tensors only), which catches ``DiffBackPackGGN`` and ``DiffBackPackEF``: they
take dict-like batches in every method. For them, :func:`dict_batch_fit` runs
``fit`` with ``_backend_cls`` replaced by an alias, a subclass that adds nothing
and whose name leaves out "BackPack"; on return (also after an exception) the
estimator's ``_backend_cls`` is put back, and a backend instance made during
``fit`` gets back the class the user chose. The decision is made with
``issubclass``; the name is changed only to pass laplace-torch's own check.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from ..backends import DiffBackPackEF, DiffBackPackGGN

#: The backends whose names laplace-torch's dict-batch check catches.
_DICT_READY = (DiffBackPackGGN, DiffBackPackEF)


def dict_batch_fit(original: Callable) -> Callable:
    """Wrap ``ParametricLaplace.fit`` so that its dict-batch check lets ours pass.

    Parameters
    ----------
    original : callable
        laplace-torch's ``fit``.

    Returns
    -------
    callable
        ``fit``, unchanged for every other backend.

    """

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        chosen = getattr(self, "_backend_cls", None)
        if not (isinstance(chosen, type) and issubclass(chosen, _DICT_READY)):
            return original(self, *args, **kwargs)
        alias = _alias(chosen)
        self._backend_cls = alias
        try:
            return original(self, *args, **kwargs)
        finally:
            self._backend_cls = chosen
            backend = getattr(self, "_backend", None)
            if type(backend) is alias:
                backend.__class__ = chosen

    return fit


def _alias(backend: type) -> type:
    """A subclass of ``backend`` that adds nothing, named without "BackPack"."""
    name = re.sub("backpack", "", backend.__name__, flags=re.IGNORECASE)
    namespace = {"__module__": backend.__module__, "__doc__": backend.__doc__}
    return type(name, (backend,), namespace)
