"""Sums over data shards for the context posterior and its evidence.

Under ``torch.distributed`` each rank's ``data`` is its shard (a loader with a
``DistributedSampler`` or the user's own split; shards may be uneven or empty).
The posterior's sums over data points are reduced with
:func:`~laplace_diffjac.context._distributed.all_reduce_sum` once per pass, so the
posterior factor and the evidence are the same on every rank.

Devices: a tensor is reduced on its own device when the group's backend
communicates there (``nccl`` for CUDA tensors); otherwise (``gloo``, or any
CPU tensor) it travels through a CPU copy and comes back to its device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ..errors import InvalidInputError
from ._data import Data
from ._distributed import all_reduce_sum, is_distributed, world_size
from ._state import Accumulators

__all__ = ["check_shard", "reduce_accumulators", "reduce_mean", "reduce_sum"]


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


def reduce_accumulators(acc: Accumulators) -> None:
    """Sum ``acc``'s data sums over the ranks, in place (one ``all_reduce``).

    ``B``, the GGN diagonal, the loss, ``N`` and the count of ranks without
    targets are packed into one float64 buffer; the counts stay exact below
    ``2⁵³``. ``J_z`` and ``K_zz`` do not depend on the data and are not reduced.

    Parameters
    ----------
    acc : Accumulators
        This rank's sums; on return the sums over all shards.

    """
    if not is_distributed():
        return
    counts = [float(acc.n_data), 0.0 if acc.has_targets else 1.0]
    flat = torch.cat(
        [
            acc.B.reshape(-1),
            acc.ggn_diag,
            acc.loss.reshape(1).to(acc.B),
            torch.tensor(counts, dtype=acc.B.dtype, device=acc.B.device),
        ]
    )
    flat = reduce_sum(flat)
    n_b, n_d = acc.B.numel(), acc.ggn_diag.numel()
    acc.B = flat[:n_b].reshape(acc.B.shape).clone()
    acc.ggn_diag = flat[n_b : n_b + n_d].clone()
    acc.loss = flat[n_b + n_d].clone()
    acc.n_data = int(round(float(flat[-2])))
    acc.has_targets = float(flat[-1]) == 0.0


def check_shard(data: Data, name: str) -> None:
    """Refuse a ``DistributedSampler`` that pads its shards with duplicates.

    ``DistributedSampler(drop_last=False)`` repeats up to ``world_size − 1``
    points so that every rank gets as many; the sums over the shards would count
    those twice.

    Parameters
    ----------
    data : DataLoader, torch.Tensor or tuple
        This rank's data.
    name : str
        The argument's name, for the message.

    Raises
    ------
    InvalidInputError
        For a padding ``DistributedSampler``.

    """
    if not isinstance(data, DataLoader):
        return
    sampler = data.sampler
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if n % sampler.num_replicas != 0:
        raise InvalidInputError(
            f"{name} uses a DistributedSampler that pads {n} points to "
            f"{sampler.total_size} with repeated points, which would count them "
            "twice in the posterior's sums. Shard the data without padding, e.g. "
            "torch.utils.data.Subset(dataset, range(rank, len(dataset), world)), "
            "or use a data set size divisible by the number of ranks."
        )
