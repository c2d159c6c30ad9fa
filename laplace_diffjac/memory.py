"""Opt-in setting of the C allocator: keep freed large blocks in the process.

On Linux, glibc's ``malloc`` hands blocks above its mmap threshold (128 KiB at
start, raised as such blocks are freed, to at most 32 MiB on 64-bit systems)
straight back to the kernel when they are freed, so every fresh tensor of that
size, e.g. each call's ``(B, C, P)`` Jacobian, is page-faulted in again, 4 KiB at
a time. :func:`keep_freed_memory` switches that off for the duration of a
``with`` block (``mallopt(M_MMAP_MAX, 0)`` and a large ``M_TRIM_THRESHOLD``): freed
blocks stay in the heap and the next tensor of that size reuses pages that are
already resident. :func:`start_keeping_freed_memory` and
:func:`stop_keeping_freed_memory` do the same where a ``with`` block does not fit
(an interactive session).

This is a **process-wide** setting, which the package never changes on its own:
nothing in ``laplace_diffjac`` calls these functions; only the user's code does.
Where the process's ``malloc`` is not glibc's (macOS, Windows, musl, a
preloaded jemalloc or tcmalloc), every function here is a no-op that says so by
returning ``False``, or raises with ``required=True``.

PyTorch's other remedy, transparent huge pages for its CPU tensors, is an
environment variable read once, at the first CPU tensor the process allocates
(in practice while the packages import), so it is chosen before Python starts,
not from here::

    THP_MEM_ALLOC_ENABLE=1 python my_script.py

What is and is not put back when the setting ends:

* ``M_MMAP_MAX`` and ``M_TRIM_THRESHOLD`` get the values they had before: the
  ones this module set for an enclosing block, or otherwise glibc's values at
  process start (65536 and 128 KiB, or those of ``GLIBC_TUNABLES``'s
  ``glibc.malloc.mmap_max`` / ``glibc.malloc.trim_threshold`` or of
  ``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment the process
  started with). glibc has no call that reads these parameters, so values that
  other code set through ``mallopt`` are not known here and not restored.
* glibc's *dynamic* mmap threshold is not restored: glibc stops adjusting it for
  the rest of the process at the first ``mallopt`` of either parameter, and no
  call turns it back on. The threshold stays at the value it had on entry
  (128 KiB up to 32 MiB, depending on what the process had freed before), and the
  trim threshold is the fixed value above instead of twice that threshold.
* The memory the heap kept is returned at the end with ``malloc_trim(0)`` (free
  pages anywhere in the heap, all arenas), but the heap keeps the address space it
  grew to: a later request that fits one of its free chunks is served from there,
  as glibc does with any free chunk of its heap, and its pages stay resident after
  it is freed until glibc trims again; only requests that fit none are mapped on
  their own again. Tensors allocated inside the block that outlive it stay in the
  heap too.
* Blocks larger than a thread's heap (64 MiB) requested from a thread other than
  the main one are still mapped and unmapped by glibc while the setting holds.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = [
    "can_keep_freed_memory",
    "keep_freed_memory",
    "start_keeping_freed_memory",
    "stop_keeping_freed_memory",
]

#: ``mallopt`` parameter numbers (glibc's ``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

#: glibc's start-up values (``DEFAULT_MMAP_MAX``, ``DEFAULT_TRIM_THRESHOLD``).
GLIBC_MMAP_MAX = 65536
GLIBC_TRIM_THRESHOLD = 128 * 1024

#: Trim threshold while freed memory is kept: 1 GiB.
DEFAULT_TRIM_THRESHOLD = 1 << 30

_INT_MAX = 2**31 - 1

#: Environment names of the two parameters: tunable, then legacy alias.
_ENVIRONMENT = {
    "mmap_max": ("glibc.malloc.mmap_max", "MALLOC_MMAP_MAX_"),
    "trim_threshold": ("glibc.malloc.trim_threshold", "MALLOC_TRIM_THRESHOLD_"),
}


@dataclass(frozen=True)
class _Parameters:
    """The two ``mallopt`` parameters this module sets."""

    mmap_max: int
    trim_threshold: int

    @property
    def keeps_freed_memory(self) -> bool:
        return self.mmap_max == 0


class _GlibcMalloc:
    """glibc's allocator of this process, and what this module last set on it.

    The process-wide setting mirrored here is the one the user asked for through
    the public functions; ``current`` is ``None`` until they set something.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.library = _load_glibc()
        self.current: _Parameters | None = None

    def set(self, params: _Parameters) -> None:
        assert self.library is not None
        ok_max = self.library.mallopt(_M_MMAP_MAX, params.mmap_max)
        ok_trim = self.library.mallopt(_M_TRIM_THRESHOLD, params.trim_threshold)
        if ok_max != 1 or ok_trim != 1:
            raise OSError(f"glibc's mallopt refused {params}.")
        self.current = params

    def restore(self, params: _Parameters | None) -> None:
        """Set ``params`` (``None``: the start-up values) and trim if no longer kept."""
        assert self.library is not None
        self.set(params or _start_values(_start_environment()))
        if params is None:
            self.current = None
        if not (params and params.keeps_freed_memory):
            self.library.malloc_trim(0)


def _load_glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc and its ``malloc`` is glibc's."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        library = ctypes.CDLL(None)
        mallopt, trim = library.mallopt, library.malloc_trim
    except (OSError, AttributeError):
        return None
    if not hasattr(library, "gnu_get_libc_version"):  # only glibc defines it
        return None
    try:  # a preloaded allocator (jemalloc, tcmalloc) interposes malloc
        own = ctypes.cast(library.__libc_malloc, ctypes.c_void_p).value
        if ctypes.cast(library.malloc, ctypes.c_void_p).value != own:
            return None
    except AttributeError:  # no __libc_malloc exported: take malloc as glibc's
        pass
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return library


def _start_environment() -> dict[str, str]:
    """The environment the process started with (what glibc read), else ``os``'s."""
    try:
        with open("/proc/self/environ", "rb") as fh:
            entries = fh.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    pairs = (e.decode(errors="replace").partition("=") for e in entries if e)
    return {name: value for name, _, value in pairs}


def _parse_number(text: str) -> int | None:
    """A number as glibc's tunables read it: decimal, ``0x`` hex or ``0`` octal."""
    text = text.strip()
    base = 16 if text[:2].lower() == "0x" else 8 if text[:1] == "0" else 10
    try:
        return int(text[2:] if base == 16 else text, base)
    except ValueError:
        return None


def _start_values(environment: dict[str, str]) -> _Parameters:
    """The values glibc started with: its defaults, or the environment's."""
    tunables = dict(
        item.partition("=")[::2]
        for item in environment.get("GLIBC_TUNABLES", "").split(":")
        if "=" in item
    )
    values = {"mmap_max": GLIBC_MMAP_MAX, "trim_threshold": GLIBC_TRIM_THRESHOLD}
    for key, (tunable, alias) in _ENVIRONMENT.items():
        for text in (tunables.get(tunable), environment.get(alias)):
            number = None if text is None else _parse_number(text)
            if number is not None and number >= 0:
                values[key] = min(number, _INT_MAX)
                break
    return _Parameters(**values)


_MALLOC = _GlibcMalloc()


def can_keep_freed_memory() -> bool:
    """Whether this process's allocator is glibc's, so that the setting applies.

    Returns
    -------
    bool
        ``True`` on Linux with glibc's ``malloc`` (not musl, not a preloaded
        jemalloc or tcmalloc); ``False`` elsewhere, where the other functions of
        this module are no-ops.

    Examples
    --------
    >>> from laplace_diffjac.memory import can_keep_freed_memory
    >>> isinstance(can_keep_freed_memory(), bool)
    True

    """
    return _MALLOC.library is not None


def _check_threshold(trim_threshold: int) -> None:
    if not 0 <= trim_threshold <= _INT_MAX:
        raise ValueError(
            f"trim_threshold must be in [0, 2**31 - 1] bytes; got {trim_threshold}."
        )


def _unavailable(required: bool) -> bool:
    """``False`` (a no-op), or raise if the caller ``required`` the setting."""
    if required:
        raise OSError(
            "keeping freed memory needs glibc's malloc on Linux; this process's "
            "allocator is another (not Linux, musl, or a preloaded allocator)."
        )
    return False


def start_keeping_freed_memory(
    trim_threshold: int = DEFAULT_TRIM_THRESHOLD, *, required: bool = False
) -> bool:
    """Keep freed large blocks in the process until :func:`stop_keeping_freed_memory`.

    Sets glibc's ``M_MMAP_MAX`` to 0 (no block is mapped on its own, so none is
    unmapped when freed) and ``M_TRIM_THRESHOLD`` to ``trim_threshold`` (the heap
    keeps up to that much free memory at its top). A process-wide setting, for
    every thread, until stopped; the package never calls this itself.

    Parameters
    ----------
    trim_threshold : int, default=1 GiB
        Free bytes the top of the heap may hold before glibc returns them.
    required : bool, default=False
        Raise instead of doing nothing where the allocator is not glibc's.

    Returns
    -------
    bool
        ``True`` if the setting now holds; ``False`` where it cannot apply (see
        :func:`can_keep_freed_memory`), and nothing was changed.

    Raises
    ------
    ValueError
        If ``trim_threshold`` is negative or does not fit a C ``int``.

    Examples
    --------
    >>> import torch
    >>> from laplace_diffjac import memory
    >>> kept = memory.start_keeping_freed_memory()
    >>> J = torch.empty(128, 10, 10_000)  # reuses pages of an earlier block
    >>> del J
    >>> memory.stop_keeping_freed_memory() == kept
    True

    """
    _check_threshold(trim_threshold)
    if _MALLOC.library is None:
        return _unavailable(required)
    with _MALLOC.lock:
        _MALLOC.set(_Parameters(0, trim_threshold))
    return True


def stop_keeping_freed_memory() -> bool:
    """Put back glibc's start-up values and return the memory the heap kept.

    Sets ``M_MMAP_MAX`` and ``M_TRIM_THRESHOLD`` to the values glibc had at process
    start (see the module's notes for what cannot be put back) and calls
    ``malloc_trim(0)``.

    Returns
    -------
    bool
        ``True`` if a setting of this module was undone; ``False`` if none held
        (nothing is changed then) or the allocator is not glibc's.

    Examples
    --------
    >>> from laplace_diffjac import memory
    >>> memory.stop_keeping_freed_memory()  # nothing was started
    False

    """
    if _MALLOC.library is None:
        return False
    with _MALLOC.lock:
        if _MALLOC.current is None:
            return False
        _MALLOC.restore(None)
    return True


@contextmanager
def keep_freed_memory(
    trim_threshold: int = DEFAULT_TRIM_THRESHOLD, *, required: bool = False
) -> Iterator[bool]:
    """Keep freed large blocks in the process for the duration of a ``with`` block.

    On entry as :func:`start_keeping_freed_memory`; on exit, also after an
    exception, the two parameters get back the values they had on entry (those of
    an enclosing block, or glibc's start-up values) and, unless an enclosing block
    still keeps freed memory, ``malloc_trim(0)`` returns what the heap kept.
    Blocks nest; they are process-wide, not per thread, so do not interleave them
    across threads.

    Parameters
    ----------
    trim_threshold : int, default=1 GiB
        Free bytes the top of the heap may hold before glibc returns them.
    required : bool, default=False
        Raise instead of doing nothing where the allocator is not glibc's.

    Yields
    ------
    bool
        Whether the setting holds inside the block (``False``: not glibc's
        allocator, nothing changed).

    Raises
    ------
    ValueError
        If ``trim_threshold`` is negative or does not fit a C ``int``.

    Examples
    --------
    Repeated Jacobians of the same size, e.g. a location optimiser's steps, then
    reuse resident pages instead of faulting fresh ones in:

    >>> import torch
    >>> from torch import nn
    >>> from laplace_diffjac import DiffBackPackGGN
    >>> from laplace_diffjac.memory import keep_freed_memory
    >>> model = nn.Sequential(nn.Linear(20, 128), nn.Tanh(), nn.Linear(128, 10))
    >>> backend = DiffBackPackGGN(model, "classification")
    >>> with keep_freed_memory() as kept:
    ...     for _ in range(3):
    ...         J, f = backend.jacobians(torch.randn(128, 20))
    >>> J.shape
    torch.Size([128, 10, 3978])

    """
    _check_threshold(trim_threshold)
    if _MALLOC.library is None:
        yield _unavailable(required)
        return
    with _MALLOC.lock:
        before = _MALLOC.current
        _MALLOC.set(_Parameters(0, trim_threshold))
    try:
        yield True
    finally:
        with _MALLOC.lock:
            _MALLOC.restore(before)
