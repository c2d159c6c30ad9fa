"""Reversible changes to laplace-torch, and the one way they are shared.

The adapter and :func:`laplace_diffjac.patch_laplace` change laplace-torch only
through :class:`AttributePatch`: each records exactly what it replaced, and
reverting puts back that very object (or deletes the attribute if the class had
inherited it), so nothing of the patch outlives it. :class:`SharedPatches` installs
a set of such changes while at least one user holds it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

_MISSING = object()


@dataclass
class AttributePatch:
    """Replace ``owner.<name>`` with ``replacement`` until :meth:`revert`.

    Parameters
    ----------
    owner : type or module
        The class (or module) whose own ``__dict__`` entry is replaced.
    name : str
        Attribute name, e.g. ``"__init__"``.
    replacement : object
        What ``owner.__dict__[name]`` holds while applied.

    """

    owner: Any
    name: str
    replacement: Any
    _original: Any = field(default=_MISSING, init=False, repr=False)
    _applied: bool = field(default=False, init=False, repr=False)

    @property
    def original(self) -> Any:
        """The ``__dict__`` entry that was replaced (only while applied)."""
        if not self._applied:
            raise RuntimeError(f"{_name(self.owner)}.{self.name} not patched.")
        return self._original

    @property
    def applied(self) -> bool:
        """Whether the replacement is installed."""
        return self._applied

    @property
    def current(self) -> bool:
        """Whether reverting is safe: not applied, or still the class's entry."""
        return not self._applied or (
            vars(self.owner).get(self.name, _MISSING) is self.replacement
        )

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
                f"{_name(self.owner)}.{self.name} was replaced again after "
                "laplace_diffjac patched it; undo that patch first."
            )
        if self._original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self._original)
        self._original = _MISSING
        self._applied = False


def _name(owner: Any) -> str:
    return str(getattr(owner, "__qualname__", getattr(owner, "__name__", owner)))


class Reversible(Protocol):
    """Something that can be applied and reverted, like :class:`AttributePatch`."""

    @property
    def current(self) -> bool:
        """Whether :meth:`revert` can undo the change without losing another's."""

    def apply(self) -> None:
        """Make the change."""

    def revert(self) -> None:
        """Undo exactly the change :meth:`apply` made."""


class SharedPatches:
    """Changes installed while at least one user holds them.

    Parameters
    ----------
    make : callable
        Builds the changes, in the order they are applied (reverted in reverse),
        when the first user arrives.
    max_users : int, optional
        At most this many users hold the changes at once; further
        :meth:`acquire` calls are no-ops (``max_users=1`` makes acquiring
        idempotent). ``None``: no limit (reference counting).

    """

    def __init__(
        self, make: Callable[[], Sequence[Reversible]], max_users: Optional[int] = None
    ) -> None:
        self._make = make
        self._max_users = max_users
        self._lock = threading.Lock()
        self._users = 0
        self._changes: Sequence[Reversible] = ()

    @property
    def active(self) -> bool:
        """Whether the changes are installed."""
        return self._users > 0

    def acquire(self) -> bool:
        """Hold the changes, installing them if this is the first user.

        Returns
        -------
        bool
            ``True`` if this call installed them.

        """
        with self._lock:
            if self._max_users is not None and self._users >= self._max_users:
                return False
            self._users += 1
            if self._users > 1:
                return False
            changes = list(self._make())
            applied: list[Reversible] = []
            try:
                for change in changes:
                    change.apply()
                    applied.append(change)
            except BaseException:
                for change in reversed(applied):
                    change.revert()
                self._users = 0
                raise
            self._changes = changes
            return True

    def release(self) -> bool:
        """Stop holding the changes, reverting them if this was the last user.

        Returns
        -------
        bool
            ``True`` if this call reverted them; ``False`` if they stay (other
            users) or were not held.

        Raises
        ------
        RuntimeError
            If the last user releases while one of the changes was itself
            replaced by someone else; nothing is reverted then, so that no
            other patch is lost.

        """
        with self._lock:
            if self._users == 0:
                return False
            if self._users == 1 and not all(c.current for c in self._changes):
                raise RuntimeError(
                    "laplace-torch was patched again on top of laplace_diffjac's "
                    "changes (for instance by an active patch_laplace()); undo "
                    "that first."
                )
            self._users -= 1
            if self._users > 0:
                return False
            for change in reversed(self._changes):
                change.revert()
            self._changes = ()
            return True


__all__ = ["AttributePatch", "Reversible", "SharedPatches"]
