"""``patch_laplace()``: run code written for BackPACK on the side-effect-free backends.

While patched, every laplace-torch estimator that is constructed with
``backend=BackPackGGN`` or ``backend=BackPackEF`` gets ``DiffBackPackGGN`` or
``DiffBackPackEF`` instead, however the class arrived: passed by the user (who
holds a reference to laplace-torch's class), as a constructor default captured at
import (``FunctionalLaplace``, ``FunctionalLLLaplace``), through the ``Laplace``
factory or through ``marglik_training(..., backend=...)``. The swap happens in
``BaseLaplace.__init__``, which every estimator runs, so ``_backend_cls`` and every
check made on it see the side-effect-free class.

Other backends (Curvlinops, ASDL, ``None``) are passed through unchanged. Estimators
built while patched keep their backend after the patch is undone; estimators built
before keep theirs.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

from laplace.baselaplace import BaseLaplace
from laplace.curvature import BackPackEF, BackPackGGN

from ..backends import DiffBackPackEF, DiffBackPackGGN
from . import _registration as adapter
from ._backend_args import wrap_init
from ._patching import AttributePatch

#: laplace-torch backend -> its side-effect-free replacement (matched by identity).
REPLACEMENTS: dict[type, type] = {
    BackPackGGN: DiffBackPackGGN,
    BackPackEF: DiffBackPackEF,
}


def _replacing_policy(backend: Any) -> tuple[Any, None]:
    for upstream, replacement in REPLACEMENTS.items():
        if backend is upstream:
            return replacement, None
    return backend, None


class _Installation:
    """The ``BaseLaplace.__init__`` patch, shared by all live handles."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._patch: AttributePatch | None = None
        self._registered_here = False

    @property
    def active(self) -> bool:
        return self._patch is not None

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                # The adapter also wraps BaseLaplace.__init__: install it first so
                # that this patch sits on top and is reverted before it.
                self._registered_here = adapter.register()
                init = vars(BaseLaplace)["__init__"]
                patch = AttributePatch(
                    BaseLaplace, "__init__", wrap_init(init, _replacing_policy)
                )
                patch.apply()
                self._patch = patch
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                if self._patch is not None:
                    self._patch.revert()
                    self._patch = None
                if self._registered_here:
                    adapter.unregister()
                    self._registered_here = False


_INSTALLATION = _Installation()


class LaplacePatch:
    """Handle of one :func:`patch_laplace` call; undo it or use it in ``with``."""

    def __init__(self) -> None:
        self._active = False
        _INSTALLATION.acquire()
        self._active = True

    @property
    def active(self) -> bool:
        """Whether this handle still holds the patch."""
        return self._active

    def undo(self) -> None:
        """Release this handle; laplace-torch is restored when the last one is.

        Idempotent.
        """
        if self._active:
            self._active = False
            _INSTALLATION.release()

    restore = undo

    def __enter__(self) -> LaplacePatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.undo()


def patch_laplace() -> LaplacePatch:
    """Redirect laplace-torch's BackPACK backends to the side-effect-free ones.

    Use it as a call (``handle = patch_laplace(); ...; handle.undo()``) or as a
    context manager (``with patch_laplace(): ...``). Handles may nest and be undone
    in any order; laplace-torch is restored exactly when the last one is undone.
    The adapter (:func:`laplace_diffjac.laplace_integration.register`) is active
    while patched.

    Returns
    -------
    LaplacePatch
        The handle; ``.undo()`` (alias ``.restore()``) or leaving ``with`` undoes it.

    Examples
    --------
    >>> from laplace import Laplace
    >>> from laplace.curvature import BackPackGGN
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> with patch_laplace():
    ...     la = Laplace(model, "regression", "all", "diag", backend=BackPackGGN)
    >>> la._backend_cls is DiffBackPackGGN
    True

    """
    return LaplacePatch()


def is_patched() -> bool:
    """Whether some :func:`patch_laplace` handle is active."""
    return _INSTALLATION.active


__all__ = ["REPLACEMENTS", "LaplacePatch", "is_patched", "patch_laplace"]
