"""Sums over data points across the processes of a ``torch.distributed`` group.

When a process group is initialised (``torchrun``, or ``init_process_group`` by
hand), each process holds its own shard of the training data; the shards, in rank
order, make up the data set. Every sum over data points (``K_ZX Λ K_XZ``, the
objective and its gradient, the evidence's terms) is then one ``all_reduce``; the
locations and the posterior factor are computed identically on every rank. Without
a process group every function here is the identity, so single-process code pays
nothing. There is no communication layer of our own: these are
``torch.distributed`` collectives, with whatever backend the group has (``gloo`` on
CPU, ``nccl`` on GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_sum", "is_distributed", "rank", "shard_offsets", "world_size"]


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Number of processes in the group (1 without one)."""
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """Rank of the calling process (0 without a group)."""
    return dist.get_rank() if is_distributed() else 0


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all processes, in place; the identity without a group.

    Parameters
    ----------
    tensor : torch.Tensor
        The local partial sum, on the device the group's backend communicates
        on (CPU for ``gloo``, CUDA for ``nccl``); same shape on every rank.

    Returns
    -------
    torch.Tensor
        ``tensor``, now holding the sum over ranks.

    """
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def shard_offsets(n_local: int, device: torch.device | None = None) -> list[int]:
    """Sizes of every rank's shard, so that rank ``r`` owns ``[o[r], o[r+1])``.

    Parameters
    ----------
    n_local : int
        Number of data points on this rank (may be 0).
    device : torch.device, optional
        Device the group's backend communicates on (default CPU).

    Returns
    -------
    list of int
        ``world_size + 1`` offsets, the last being the global ``N``.

    """
    sizes = torch.zeros(world_size(), dtype=torch.int64, device=device)
    sizes[rank()] = n_local
    all_reduce_sum(sizes)
    offsets = [0]
    for size in sizes.tolist():
        offsets.append(offsets[-1] + int(size))
    return offsets
