"""The CPU allocator setting a measuring process runs under.

``default``
    glibc's allocator as it starts, PyTorch's huge pages off
    (``THP_MEM_ALLOC_ENABLE`` removed from the process's environment).
``thp``
    PyTorch's huge-page allocation: ``THP_MEM_ALLOC_ENABLE=1`` in the environment
    the process starts with (PyTorch reads it once, at its first CPU tensor).
``mmap-off``
    glibc keeps freed large blocks: the measurement runs inside
    :func:`laplace_diffjac.memory.keep_freed_memory` (``required=True``: a process
    whose allocator is not glibc's fails instead of measuring the default).

A setting applies to a fresh process: :func:`process_environment` gives its
environment, :func:`applied` wraps its measurement and checks that the
environment matches.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

ALLOCATORS = ("default", "thp", "mmap-off")

_THP = "THP_MEM_ALLOC_ENABLE"


def process_environment(
    setting: str, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a fresh measuring process under ``setting``."""
    _check(setting)
    env = {k: v for k, v in (os.environ if base is None else base).items()}
    env.pop(_THP, None)
    if setting == "thp":
        env[_THP] = "1"
    return env


@contextmanager
def applied(setting: str) -> Iterator[None]:
    """Run the body under ``setting``; refuse if the process started otherwise."""
    _check(setting)
    thp = os.environ.get(_THP) == "1"
    if thp != (setting == "thp"):
        raise RuntimeError(
            f"allocator {setting!r} needs a process started "
            + ("with" if setting == "thp" else "without")
            + f" {_THP}=1 (see allocator.process_environment)"
        )
    if setting != "mmap-off":
        yield
        return
    from laplace_diffjac.memory import keep_freed_memory

    with keep_freed_memory(required=True):
        yield


def describe(setting: str) -> str:
    """One line of Markdown on what ``setting`` means."""
    _check(setting)
    return {
        "default": "glibc's default, PyTorch's huge pages off",
        "thp": f"PyTorch's huge pages (`{_THP}=1` at process start)",
        "mmap-off": "glibc keeps freed blocks "
        "(`laplace_diffjac.memory.keep_freed_memory`: `M_MMAP_MAX` 0, "
        "`M_TRIM_THRESHOLD` 1 GiB)",
    }[setting]


def _check(setting: str) -> None:
    if setting not in ALLOCATORS:
        raise ValueError(f"allocator {setting!r}: one of {ALLOCATORS}")
