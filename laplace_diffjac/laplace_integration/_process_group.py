"""The few ``torch.distributed`` collectives the distributed fit needs.

Without an initialised process group (or with one of size 1) nothing here
communicates. The collectives are ``torch.distributed``'s own, on the device the
group's backend uses (CPU for ``gloo``, the current CUDA device for ``nccl``).
(``laplace_diffjac.context._distributed`` holds similar helpers for the context
posteriors; they are kept apart so that the two layers can change independently.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_object",
    "all_reduce_sum",
    "all_reduce_sum_",
    "broadcast_object",
    "communication_device",
    "is_multi_process",
    "rank",
    "world_size",
]


def is_multi_process() -> bool:
    """Whether a process group with more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of processes in the group (1 without one)."""
    return dist.get_world_size() if is_multi_process() else 1


def rank() -> int:
    """Rank of the calling process (0 without a group)."""
    return dist.get_rank() if is_multi_process() else 0


def communication_device() -> torch.device:
    """The device tensors must be on for the group's collectives."""
    if is_multi_process() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks (a new tensor, on ``tensor``'s device).

    Parameters
    ----------
    tensor : torch.Tensor
        This rank's partial sum; same shape and dtype on every rank.

    Returns
    -------
    torch.Tensor
        The sum over ranks; ``tensor`` itself without a group.

    """
    if not is_multi_process():
        return tensor
    buffer = tensor.detach().to(communication_device(), copy=True)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    return buffer.to(tensor.device)


def all_reduce_sum_(buffer: torch.Tensor) -> torch.Tensor:
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
    return all_reduce_sum(buffer)


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
