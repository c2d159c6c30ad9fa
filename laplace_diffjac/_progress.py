"""Progress bars that suit where they are written: a terminal or a log.

On a terminal a progress bar redraws itself in place, as tqdm does. Written to a
file (a job's log under ``nohup``, CI or a batch system, a notebook's captured
output), every redraw is kept: tqdm's bar with a postfix set each step leaves one
carriage-return-joined record per step, 20 kB of one line for a 200-step demo. There the
package writes plain lines instead: one when the loop has run for
``LOG_INTERVAL_S`` seconds since the last line, and one when it ends, with the
count, the elapsed time and the last postfix::

    Locations: 200/200 in 3.2 s (objective=12.34)

Every loop of the package that shows progress goes through :func:`progress`.
Whether stderr is a terminal is read when the loop starts; nothing is kept
between calls.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Generic, TextIO, TypeVar

from tqdm import tqdm

__all__ = ["LOG_INTERVAL_S", "LogProgress", "progress"]

T = TypeVar("T")

#: Seconds between two lines of a loop's progress in a log.
LOG_INTERVAL_S = 30.0


class LogProgress(Generic[T]):
    """A loop's progress as a few whole lines, for a stream that is not a terminal.

    Parameters
    ----------
    iterable : iterable
        What the loop runs over.
    desc : str
        The loop's name, at the start of each line.
    total : int, optional
        Its length, when known (``len(iterable)`` by default where it has one).
    stream : TextIO
        Where the lines go.
    enabled : bool
        Write nothing when ``False``.
    interval : float
        Seconds between two lines while the loop runs.
    """

    def __init__(
        self,
        iterable: Iterable[T],
        desc: str,
        total: int | None,
        stream: TextIO,
        enabled: bool,
        interval: float,
    ) -> None:
        self._iterable = iterable
        self._desc = desc
        self._total = total if total is not None else _length(iterable)
        self._stream = stream
        self._enabled = enabled
        self._interval = interval
        self._count = 0
        self._postfix = ""
        self._start = self._last = time.monotonic()
        self._closed = False

    def __iter__(self) -> Iterator[T]:
        """Yield the items, writing a line every ``interval`` seconds."""
        try:
            for item in self._iterable:
                now = time.monotonic()
                if now - self._last >= self._interval:
                    self._last = now
                    self._write()
                self._count += 1  # handed out: a loop that breaks after it ran it
                yield item
        finally:
            self.close()

    def set_postfix(self, refresh: bool = False, **values: object) -> None:
        """Keep ``values`` for the next line (as tqdm's ``set_postfix``)."""
        del refresh  # a line is written on the interval or at the end only
        self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        """Write the final line, once."""
        if not self._closed:
            self._closed = True
            self._write()

    def _write(self) -> None:
        if not self._enabled:
            return
        of = f"/{self._total}" if self._total is not None else ""
        seconds = time.monotonic() - self._start
        tail = f" ({self._postfix})" if self._postfix else ""
        self._stream.write(
            f"{self._desc}: {self._count}{of} in {seconds:.1f} s{tail}\n"
        )
        self._stream.flush()


def progress(
    iterable: Iterable[T],
    *,
    desc: str,
    enabled: bool = True,
    total: int | None = None,
) -> tqdm[T] | LogProgress[T]:
    """A progress bar over ``iterable``: tqdm on a terminal, a few lines elsewhere.

    Parameters
    ----------
    iterable : iterable
        What the loop runs over.
    desc : str
        The loop's name.
    enabled : bool, default=True
        Show nothing when ``False``.
    total : int, optional
        The length, where ``iterable`` has none.

    Returns
    -------
    tqdm or LogProgress
        Iterate over it; both take ``set_postfix(**values)`` and ``close()``.
    """
    stream = sys.stderr
    if stream is None:  # no stderr at all (pythonw)
        return tqdm(iterable, desc=desc, total=total, disable=True)
    if _is_terminal(stream):
        return tqdm(iterable, desc=desc, total=total, disable=not enabled)
    return LogProgress(iterable, desc, total, stream, enabled, LOG_INTERVAL_S)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _length(iterable: Iterable[object]) -> int | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None
