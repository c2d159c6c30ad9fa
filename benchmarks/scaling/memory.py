"""This process's resident memory from ``/proc`` (Linux): now, and its peak.

Shared by ``scaling.py`` and ``distributed_fit.py``, whose rows report the work's
own peak (the high-water mark reset after imports, model and data) beside the
process's whole one.
"""

from __future__ import annotations

import pathlib


def rss_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, KiB."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS; return that peak, KiB.

    Linux resets ``VmHWM`` when ``5`` is written to ``/proc/self/clear_refs``;
    the peak measured afterwards is then the work's own high-water mark, not
    that of the imports before it. The reset ``VmHWM`` is returned, not
    ``VmRSS``: the kernel syncs its RSS counters lazily, and a difference of
    one counter cannot go negative.
    """
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    return rss_kib("VmHWM")
