"""Run a function on K real ``gloo`` processes (``torch.multiprocessing.spawn``)."""

from __future__ import annotations

import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(
    rank: int, world: int, folder: str, fn: Callable[..., Any], args: tuple
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=world,
    )
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(folder, f"result_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` gloo processes; their results.

    ``fn`` must be importable (a module-level function of a test module) and its
    result saveable with ``torch.save``.
    """
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(world, folder, fn, args), nprocs=world, join=True)
        return [
            torch.load(pathlib.Path(folder) / f"result_{r}.pt", weights_only=False)
            for r in range(world)
        ]
