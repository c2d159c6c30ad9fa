"""Reversible replacement of one attribute on one class.

The adapter and :func:`laplace_diffjac.patch_laplace` change laplace-torch only
through :class:`AttributePatch`: each records exactly what it replaced, and
reverting puts back that very object (or deletes the attribute if the class had
inherited it), so nothing of the patch outlives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_MISSING = object()


@dataclass
class AttributePatch:
    """Replace ``owner.<name>`` with ``replacement`` until :meth:`revert`.

    Parameters
    ----------
    owner : type
        The class whose own ``__dict__`` entry is replaced.
    name : str
        Attribute name, e.g. ``"__init__"``.
    replacement : object
        What ``owner.__dict__[name]`` holds while applied.

    """

    owner: type
    name: str
    replacement: Any
    _original: Any = field(default=_MISSING, init=False, repr=False)
    _applied: bool = field(default=False, init=False, repr=False)

    @property
    def original(self) -> Any:
        """The ``__dict__`` entry that was replaced (only while applied)."""
        if not self._applied:
            raise RuntimeError(f"{self.owner.__qualname__}.{self.name} not patched.")
        return self._original

    @property
    def applied(self) -> bool:
        """Whether the replacement is installed."""
        return self._applied

    def apply(self) -> None:
        """Install the replacement, remembering the class's own entry."""
        if self._applied:
            return
        self._original = vars(self.owner).get(self.name, _MISSING)
        setattr(self.owner, self.name, self.replacement)
        self._applied = True

    def revert(self) -> None:
        """Put back exactly what :meth:`apply` found.

        Raises
        ------
        RuntimeError
            If someone else replaced the attribute after :meth:`apply`; their
            replacement would be lost, so nothing is changed.

        """
        if not self._applied:
            return
        current = vars(self.owner).get(self.name, _MISSING)
        if current is not self.replacement:
            raise RuntimeError(
                f"{self.owner.__qualname__}.{self.name} was replaced again after "
                "laplace_diffjac patched it; undo that patch first."
            )
        if self._original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self._original)
        self._original = _MISSING
        self._applied = False


__all__ = ["AttributePatch"]
