"""The working-memory budget that the package's chunked paths honour.

A path that can trade memory for recomputation sizes its chunks so that the
memory it holds at once, the autograd graph it keeps for a gradient included,
stays within this budget: :func:`laplace_diffjac.ntk` and
:func:`laplace_diffjac.ntk_diag`; :class:`laplace_diffjac.ContextPosterior`'s fit,
``update``, predictions and evidence (data in chunks, locations in blocks held or
recomputed); :func:`laplace_diffjac.optimize_locations` (the gap's step, its
training-feature cache, and the evidence objective's two passes);
``LocationFunctionalLaplace``'s fit and predictions; and the BackPACK backends'
``jacobians`` and ``full``, whose chunks of per-sample Jacobians take at most half
of it unless a ``jacobian_budget`` is given (the Jacobians returned are the
user's, not working memory). By default the budget is 2 GiB on a CPU and a
quarter of the memory free on a GPU when the call starts; a user sets another
limit once::

    import laplace_diffjac

    laplace_diffjac.set_memory_budget("8 GiB")  # from here on, in this context
    with laplace_diffjac.memory_budget("512 MiB"):  # only inside the block
        K = laplace_diffjac.ntk(backend, x)

The setting lives in a :class:`contextvars.ContextVar`: a ``with`` block restores
the previous value when it ends, and threads and asyncio tasks each see the value
of the context they started in. The result of a call (a Gram of ``B1 × B2 × C ×
C`` numbers, say) is the user's, not working memory, and is not counted. A request
whose smallest chunk does not fit raises :class:`MemoryBudgetError` before any
chunk is computed, naming the budget, what the request needs and what would fit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Union

import torch

from .errors import MemoryBudgetError

__all__ = [
    "MemoryBudgetError",
    "format_bytes",
    "get_memory_budget",
    "memory_budget",
    "parse_bytes",
    "set_memory_budget",
]

#: The default budget on a CPU: 2 GiB of working memory.
CPU_DEFAULT_BYTES = 2 * 2**30

#: The default budget on a GPU: this share of the memory free when a call starts.
GPU_FREE_SHARE = 0.25

ByteLimit = Union[int, float, str]

_LIMIT: ContextVar[int | None] = ContextVar(
    "laplace_diffjac_memory_budget", default=None
)

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(limit: ByteLimit) -> int:
    """Read a byte count: a number of bytes, or a string such as ``"2 GiB"``.

    Parameters
    ----------
    limit : int, float or str
        Bytes, or a number followed by one of B, kB, MB, GB, TB (powers of 1000)
        or KiB, MiB, GiB, TiB (powers of 1024), in any case.

    Returns
    -------
    int
        The number of bytes, rounded down.

    Raises
    ------
    ValueError
        If the string has no number or an unknown unit, or the count is not
        positive.

    """
    if isinstance(limit, str):
        match = re.fullmatch(
            r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", limit.lower()
        )
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(
                f"Cannot read {limit!r} as a memory size: write bytes as a number, or "
                "a number and a unit such as '512 MiB' or '2 GiB'."
            )
        value = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        value = float(limit)
    if not value >= 1:
        raise ValueError(f"A memory budget must be at least one byte; got {limit!r}.")
    return int(value)


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps the number at least 1."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def set_memory_budget(limit: ByteLimit | None) -> int | None:
    """Set the working-memory budget for the current context.

    Parameters
    ----------
    limit : int, float, str or None
        Bytes (see :func:`parse_bytes`); ``None`` returns to the per-device
        default (2 GiB on a CPU, a quarter of the free memory on a GPU).

    Returns
    -------
    int or None
        The limit set before, ``None`` for the default.

    """
    previous = _LIMIT.get()
    _LIMIT.set(None if limit is None else parse_bytes(limit))
    return previous


@contextmanager
def memory_budget(limit: ByteLimit | None) -> Iterator[None]:
    """Use ``limit`` as the working-memory budget inside a ``with`` block.

    Parameters
    ----------
    limit : int, float, str or None
        As for :func:`set_memory_budget`.

    Yields
    ------
    None
        The previous budget is back when the block ends, whatever happens in it.

    """
    token = _LIMIT.set(None if limit is None else parse_bytes(limit))
    try:
        yield
    finally:
        _LIMIT.reset(token)


def get_memory_budget(device: torch.device | str | None = None) -> int:
    """The bytes of working memory a call on ``device`` may hold at once.

    Parameters
    ----------
    device : torch.device or str, optional
        The device the call computes on; default the CPU.

    Returns
    -------
    int
        The limit set by :func:`set_memory_budget` or :func:`memory_budget`, or
        else the device's default: 2 GiB on a CPU, a quarter of the memory free
        now on a CUDA device.

    """
    limit = _LIMIT.get()
    if limit is not None:
        return limit
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_FREE_SHARE)
    return CPU_DEFAULT_BYTES


def over_budget(what: str, needs: int, budget: int, fits: str) -> str:
    """The message for a request whose smallest chunk needs more than the budget.

    Parameters
    ----------
    what : str
        The request, e.g. ``"ntk of 64 × 64 inputs"``.
    needs : int
        Bytes its smallest chunk would hold at once.
    budget : int
        The budget in force.
    fits : str
        What would fit, in words.

    Returns
    -------
    str
        Naming the budget, the need and the way out, for
        :class:`MemoryBudgetError`.

    """
    return (
        f"{what} needs {format_bytes(needs)} of working memory in its smallest "
        f"chunk, above the memory budget of {format_bytes(budget)}. {fits} Raise "
        "the budget with laplace_diffjac.set_memory_budget(...) or "
        "`with laplace_diffjac.memory_budget(...):`."
    )
