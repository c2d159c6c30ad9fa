"""A rank's shard of the data set: its global rows, and shards that count twice.

Under ``torch.distributed`` each rank passes its own shard; the shards in rank
order form the data set, and global indices run over them in that order
(:func:`~laplace_diffjac.data.shard_offsets`), so a draw of global indices is the
draw a single process makes on the concatenated data.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..errors import InvalidInputError
from ._process_group import all_reduce_sum

__all__ = ["assemble_rows", "check_shard", "local_indices"]


def local_indices(idx: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The global indices ``idx`` that fall in ``[lo, hi)``, as local indices.

    Parameters
    ----------
    idx : torch.Tensor
        Global indices ``(b,)`` (int64).
    lo, hi : int
        This rank's global range.

    Returns
    -------
    torch.Tensor
        ``(b_local,)`` local indices, in the order of ``idx`` (possibly empty).

    """
    return idx[(idx >= lo) & (idx < hi)] - lo


def assemble_rows(
    x_local: torch.Tensor, idx: torch.Tensor, lo: int, device: torch.device
) -> torch.Tensor:
    """Rows ``idx`` (global) of the concatenated shards, on every rank.

    Each rank writes the rows it owns into a zero ``(len(idx), *input_shape)``
    tensor and the tensors are summed over ranks (every row has one owner, so
    the result is exact).

    Parameters
    ----------
    x_local : torch.Tensor
        This rank's shard ``(n_local, *input_shape)``.
    idx : torch.Tensor
        Global indices ``(k,)``, the same on every rank.
    lo : int
        Global index of this rank's first row.
    device : torch.device
        Device of the result (the one the group communicates on).

    Returns
    -------
    torch.Tensor
        ``(k, *input_shape)``, in ``x_local``'s dtype, on ``device``.

    """
    idx = idx.cpu()
    rows = torch.zeros(
        (idx.shape[0], *x_local.shape[1:]), dtype=x_local.dtype, device=device
    )
    mine = (idx >= lo) & (idx < lo + x_local.shape[0])
    rows[mine.to(device)] = x_local[(idx[mine] - lo).to(x_local.device)].to(device)
    return all_reduce_sum(rows)


def check_shard(data: object, name: str) -> None:
    """Refuse a ``DistributedSampler`` that pads its shards with duplicates.

    ``DistributedSampler(drop_last=False)`` repeats up to ``world_size − 1``
    points so that every rank gets as many; sums over the shards would count
    those twice.

    Parameters
    ----------
    data : object
        This rank's data; only a ``DataLoader`` is looked at.
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
            "twice in sums over the data. Shard the data without padding, e.g. "
            "torch.utils.data.Subset(dataset, range(rank, len(dataset), world)), "
            "or use a data set size divisible by the number of ranks."
        )
