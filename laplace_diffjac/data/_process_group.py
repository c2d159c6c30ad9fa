"""Sums over data points across the processes of a ``torch.distributed`` group.

The only module through which the package's computations talk to
``torch.distributed`` (:mod:`._ranks` only starts local groups for the tests
and benchmarks).

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

from typing import Any

import torch
import torch.distributed as dist

from ..errors import InvalidInputError

__all__ = [
    "all_gather_object",
    "all_reduce_sum",
    "broadcast_object",
    "communication_device",
    "is_multi_process",
    "reduce_sum_in_place",
    "check_same_on_ranks",
    "is_distributed",
    "max_over_ranks",
    "rank",
    "reduce_mean",
    "reduce_sum",
    "shard_offsets",
    "world_size",
]


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


def _communicates_on(device: torch.device) -> torch.device:
    """Where the group's backend can reduce a tensor that lives on ``device``."""
    if device.type == "cpu":
        return device
    backend = str(dist.get_backend())  # 'gloo', 'nccl' or 'cpu:gloo,cuda:nccl'
    if "nccl" in backend and device.type == "cuda":
        return device
    return torch.device("cpu")


def reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over the ranks, on ``tensor``'s device (a new tensor).

    A tensor is reduced on its own device when the group's backend communicates
    there (``nccl`` for CUDA tensors); otherwise (``gloo``, or any CPU tensor) it
    travels through a CPU copy and comes back to its device.

    Parameters
    ----------
    tensor : torch.Tensor
        This rank's partial sum; same shape and dtype on every rank.

    Returns
    -------
    torch.Tensor
        The sum over ranks (``tensor`` itself without a process group).

    """
    if not is_distributed():
        return tensor
    buffer = tensor.detach().to(_communicates_on(tensor.device), copy=True)
    return all_reduce_sum(buffer).to(tensor.device)


def reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of ``tensor`` over the ranks (``tensor`` without a process group)."""
    return reduce_sum(tensor) / world_size() if is_distributed() else tensor


def max_over_ranks(value: int, device: torch.device) -> int:
    """Largest of a non-negative integer over ranks (by one sum of a one-hot)."""
    if not is_distributed():
        return value
    votes = torch.zeros(world_size(), dtype=torch.int64, device=device)
    votes[rank()] = value
    return int(all_reduce_sum(votes).max())


def check_same_on_ranks(x: torch.Tensor, name: str) -> None:
    """Raise on every rank unless ``x`` is the same on all ranks.

    A cheap check: one all-reduce of two numbers (a position-weighted checksum
    ``c`` and ``c²``); the ranks agree iff ``K Σ c² = (Σ c)²`` (up to rounding).

    Parameters
    ----------
    x : torch.Tensor
        A tensor of the same shape on every rank.
    name : str
        Argument name for the message.

    Raises
    ------
    InvalidInputError
        If the checksums differ between ranks.

    """
    if not is_distributed():
        return
    flat = x.detach().reshape(-1).to(torch.float64)
    weights = torch.linspace(
        1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device
    )
    c = (flat * weights).sum()
    sums = all_reduce_sum(torch.stack([c, c * c]))
    spread = float(world_size() * sums[1] - sums[0] ** 2)
    if abs(spread) > 1e-10 * max(float(sums[0] ** 2), 1e-300):
        raise InvalidInputError(
            f"{name} differs between the ranks of the process group; pass the "
            "same tensor on every rank (e.g. broadcast it from rank 0)."
        )


def is_multi_process() -> bool:
    """Whether a process group with more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def communication_device() -> torch.device:
    """The device tensors must be on for the group's collectives."""
    if is_multi_process() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_sum_in_place(buffer: torch.Tensor) -> torch.Tensor:
    """Sum a buffer the caller owns over the ranks, in place where possible.

    Parameters
    ----------
    buffer : torch.Tensor
        This rank's partial sums (overwritten when it is on the device the group
        communicates on, so no copy of it is made).

    Returns
    -------
    torch.Tensor
        The sums over ranks, on ``buffer``'s device.

    """
    if is_multi_process() and buffer.device == communication_device():
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        return buffer
    return reduce_sum(buffer)


def broadcast_object(obj: Any, source: int) -> Any:
    """``obj`` of rank ``source``, on every rank (pickled; keep it small)."""
    if not is_multi_process():
        return obj
    box = [obj if rank() == source else None]
    dist.broadcast_object_list(box, src=source, device=communication_device())
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; keep it small)."""
    if not is_multi_process():
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
