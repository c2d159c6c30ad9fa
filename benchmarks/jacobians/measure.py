"""Timing and memory helpers for the benchmark workers, on the CPU or a GPU.

On a CUDA device every timed call ends with ``torch.cuda.synchronize`` (kernels
run asynchronously) and peak memory is the CUDA caching allocator's high-water
mark of allocated tensors; on the CPU it is the process's resident high-water mark.
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
from collections.abc import Callable, Hashable

import torch

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def median_seconds(
    fn: Callable[[], object], *, budget_s: float, min_reps: int, max_reps: int
) -> tuple[float, int]:
    """Median wall time of ``fn()`` over at least ``min_reps`` runs.

    Repeats until ``budget_s`` is spent or ``max_reps`` runs are done.

    Returns
    -------
    median : float
        Seconds.
    reps : int
        Runs timed.
    """
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= min_reps and time.perf_counter() - start > budget_s:
            break
    return statistics.median(times), len(times)


def interleaved_seconds(
    tasks: dict[Hashable, Callable[[], object]],
    *,
    budget_s: float,
    min_reps: int,
    max_reps: int,
) -> dict[Hashable, tuple[float, int]]:
    """Median wall time of every task, run in turn round after round.

    Each round runs every task still being timed once, starting from a different
    task each round. A task is timed at least ``min_reps`` and at most
    ``max_reps`` times, and no more once its own runs have taken ``budget_s``.

    Returns
    -------
    dict
        ``key -> (median seconds, runs timed)``.
    """
    keys = list(tasks)
    times: dict[Hashable, list[float]] = {k: [] for k in keys}
    spent = dict.fromkeys(keys, 0.0)

    def active(k: Hashable) -> bool:
        n = len(times[k])
        return n < min_reps or (n < max_reps and spent[k] < budget_s)

    rnd = 0
    while any(active(k) for k in keys):
        shift = rnd % len(keys)
        for k in keys[shift:] + keys[:shift]:
            if active(k):
                t0 = time.perf_counter()
                tasks[k]()
                dt = time.perf_counter() - t0
                times[k].append(dt)
                spent[k] += dt
        rnd += 1
    return {k: (statistics.median(v), len(v)) for k, v in times.items()}


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_mib() -> float:
    """Resident set size now, MiB."""
    gc.collect()
    kib = _status_kib("VmRSS")
    if kib is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return kib / 1024.0


def reset_peak_rss() -> bool:
    """Reset the kernel's resident high-water mark (Linux >= 4.0); ``False`` if not."""
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Resident high-water mark, MiB (since the last :func:`reset_peak_rss`)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return kib / 1024.0


def synchronized(
    fn: Callable[[], object], device: torch.device
) -> Callable[[], object]:
    """``fn`` that waits for the device's kernels before returning (CUDA)."""
    if device.type != "cuda":
        return fn

    def run() -> object:
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return run


def start_peak(device: torch.device) -> float:
    """Reset the peak-memory mark of ``device``; the memory in use now, MiB."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    gc.collect()
    if reset_peak_rss():
        # the reset high-water mark, not VmRSS: the kernel syncs its RSS counters
        # lazily, and a difference of one counter cannot go negative
        return peak_rss_mib()
    return current_rss_mib()


def peak_mib(device: torch.device) -> float:
    """Peak memory of ``device`` since :func:`start_peak`, MiB."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mib()


def counted_flops(fn: Callable[[], object]) -> int:
    """Floating-point operations of ``fn()`` by ``torch.utils.flop_counter``.

    The counter sees the matmul-like kernels only (mm, addmm, bmm, baddbmm,
    convolutions and their backward, the attention kernels it has formulas for),
    two operations per multiply-add, at the shapes they run with (einsum and
    ``vmap`` counted as the bmm/mm they lower to); elementwise operations,
    reductions, copies, scatters and kernels without a formula (e.g. CPU flash
    attention) count zero.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    # Totals only: the counter's module tracker hooks every module's backward,
    # and those hooks fail inside a backward that calls ``autograd.grad`` (the
    # memory budget's recomputation), so it is swapped for one that tracks none.
    counter.mod_tracker = _NoModules()  # type: ignore[assignment]
    with counter:
        fn()
    return int(counter.get_total_flops())


class _NoModules:
    """A stand-in for ``FlopCounterMode``'s module tracker: every count is global."""

    parents = {"Global"}

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def matmul_size(device: torch.device, quick: bool) -> int:
    """A square matmul big enough to reach the device's rate (smaller if quick)."""
    if device.type == "cuda":
        return 1024 if quick else 8192
    return 512 if quick else 2048


def matmul_gflop_per_s(device: torch.device, size: int, reps: int = 5) -> float:
    """The rate of a square float32 ``mm`` of ``size`` on ``device``, GFLOP/s.

    The reference beside each route's achieved rate: what this machine's matmul
    reaches in the same process, a practical ceiling for contraction-bound work.
    """
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    synchronized(lambda: a @ b, device)()  # warm-up (library initialisation)
    seconds, _ = median_seconds(
        synchronized(lambda: a @ b, device), budget_s=0.0, min_reps=reps, max_reps=reps
    )
    return 2 * size**3 / seconds / 1e9
