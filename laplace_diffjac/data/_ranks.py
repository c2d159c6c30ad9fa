"""Run a function on K local processes of a ``gloo`` group: a CPU stand-in for torchrun.

The package's own code never starts processes; this is the one launcher of the
tests of the distributed paths and of the multi-process benchmarks
(``benchmarks/scaling/``). :func:`run_on_ranks` starts the ranks by forking this
process where that is safe (the tests: no rank pays seconds of imports) or as fresh
interpreters (``start_method="spawn"``, as torchrun starts them: the benchmarks);
each joins a ``gloo`` group whose rendezvous is a
file in a temporary folder (so no port is chosen and no environment variable is
set), calls the function with one thread, saves its result beside that file and
leaves the group.
"""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(
    rank: int, world: int, folder: str, fn: Callable[..., Any], args: tuple
) -> None:
    """One spawned process: join the group, call ``fn``, save its result, leave."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world
    )
    try:
        result = fn(rank, world, *args)
        torch.save(result, pathlib.Path(folder) / f"result_{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any], world: int, *args: Any, start_method: str | None = None
) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` gloo processes; their results.

    An exception on any rank is raised here (``torch.multiprocessing.spawn``'s
    ``ProcessRaisedException``, with that rank's traceback).

    Parameters
    ----------
    fn : callable
        A module-level function (the spawned processes import it by name), called
        with the process group initialised and one thread per process; its result
        must pickle (it comes back through ``torch.save``).
    world : int
        Number of processes (ranks ``0 … world - 1``).
    *args
        Further arguments of ``fn``, pickled to every rank.
    start_method : {None, "fork", "spawn", "forkserver"}, optional
        How the ranks start; by default ``fork`` where the platform has it and
        CUDA is not initialised in this process, else ``spawn``.

    Returns
    -------
    list
        ``fn``'s result on each rank, in rank order.

    """
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            _rank_main,
            args=(world, folder, fn, args),
            nprocs=world,
            join=True,
            start_method=start_method or _default_start_method(),
        )
        return [
            torch.load(pathlib.Path(folder) / f"result_{r}.pt", weights_only=False)
            for r in range(world)
        ]


def _default_start_method() -> str:
    """The start method of the ranks when the caller names none.

    A forked rank inherits the imported modules (torch, laplace-torch: seconds of
    imports per rank under ``spawn``); it sets one thread before any work, and a
    process that has initialised CUDA cannot fork safely.

    Returns
    -------
    str
        ``"fork"`` where the platform has it and CUDA is not initialised here,
        else ``"spawn"``.
    """
    if "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"
