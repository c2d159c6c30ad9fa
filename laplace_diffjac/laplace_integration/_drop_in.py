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

from types import TracebackType

from laplace.baselaplace import BaseLaplace
from laplace.curvature import BackPackEF, BackPackGGN

from ..backends import DiffBackPackEF, DiffBackPackGGN
from . import _registration as adapter
from ._backend_args import wrap_init
from ._patching import AttributePatch, Reversible, SharedPatches

#: laplace-torch backend -> its side-effect-free replacement (matched by identity).
REPLACEMENTS: dict[type, type] = {
    BackPackGGN: DiffBackPackGGN,
    BackPackEF: DiffBackPackEF,
}


def _replacing_policy(backend: object) -> tuple[object, None]:
    for upstream, replacement in REPLACEMENTS.items():
        if backend is upstream:
            return replacement, None
    return backend, None


class _AdapterHold:
    """Registers the adapter while applied, unless it was registered already."""

    def __init__(self) -> None:
        self._registered_here = False

    @property
    def current(self) -> bool:
        """Always safe to revert: unregistering checks its own patches."""
        return True

    def apply(self) -> None:
        self._registered_here = adapter.register()

    def revert(self) -> None:
        if self._registered_here:
            adapter.unregister()
            self._registered_here = False


class _InitSwap:
    """Wraps ``BaseLaplace.__init__`` as it is when applied (adapter included)."""

    def __init__(self) -> None:
        self._patch: AttributePatch | None = None

    @property
    def current(self) -> bool:
        """Whether the wrapper is still ``BaseLaplace``'s own ``__init__``."""
        return self._patch is None or self._patch.current

    def apply(self) -> None:
        init = vars(BaseLaplace)["__init__"]
        self._patch = AttributePatch(
            BaseLaplace, "__init__", wrap_init(init, _replacing_policy)
        )
        self._patch.apply()

    def revert(self) -> None:
        if self._patch is not None:
            self._patch.revert()
            self._patch = None


def _make_patches() -> list[Reversible]:
    # The adapter may wrap BaseLaplace.__init__ too: it is installed first, so the
    # swap wraps it and is reverted before it.
    return [_AdapterHold(), _InitSwap()]


#: The drop-in's changes, reference-counted over all live handles.
_INSTALLATION = SharedPatches(_make_patches)


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
        The handle; ``.undo()`` or leaving ``with`` undoes it.

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
