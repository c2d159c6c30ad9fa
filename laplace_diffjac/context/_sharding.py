"""The location optimiser's global quantities over the shards of a process group.

Every function here works on the calling rank's shard and combines the ranks'
contributions with :func:`._distributed.all_reduce_sum`; without a process group
it is the single-process computation. Global indices run over the shards in rank
order (:func:`._distributed.shard_offsets`), so a draw of global indices is the
same draw as the single-process run makes on the concatenated data.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import InvalidInputError
from ._distributed import all_reduce_sum, is_distributed, rank, world_size

__all__ = [
    "Moments",
    "assemble_rows",
    "check_same_on_ranks",
    "default_lr",
    "local_indices",
    "sync_gradient",
]

_F64 = torch.float64


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


class Moments:
    """Streaming per-feature count, mean and squared deviations of inputs.

    Batches are merged as in Chan et al. (1979); :meth:`default_lr` merges the
    ranks' moments with two all-reduces. Memory: ``O(D)``.
    """

    def __init__(self) -> None:
        self.n = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None

    def add(self, xb: torch.Tensor) -> None:
        """Merge a batch ``(b, *input_shape)`` into the moments."""
        if xb.shape[0] == 0:
            return
        flat = xb.detach().reshape(xb.shape[0], -1).to(_F64)
        bn, bmean = flat.shape[0], flat.mean(0)
        bm2 = (flat - bmean).square().sum(0)
        if self.mean is None or self.m2 is None:
            self.n, self.mean, self.m2 = bn, bmean, bm2
            return
        delta, total = bmean - self.mean, self.n + bn
        self.mean = self.mean + delta * (bn / total)
        self.m2 = self.m2 + bm2 + delta.square() * (self.n * bn / total)
        self.n = total

    def default_lr(self, device: torch.device) -> float:
        """``0.05`` times the mean per-feature std over all ranks (``0.05`` if N<=1).

        Parameters
        ----------
        device : torch.device
            Device the process group communicates on.

        Returns
        -------
        float
            The learning rate.

        """
        return _merge_moments(self.n, self.mean, self.m2, device)


def default_lr(batches: Iterable[torch.Tensor], device: torch.device) -> float:
    """``0.05`` times the data set's mean per-feature standard deviation.

    Parameters
    ----------
    batches : iterable of torch.Tensor
        This rank's inputs, ``(b, *input_shape)`` batches (possibly none).
    device : torch.device
        Device the process group communicates on.

    Returns
    -------
    float
        The learning rate (``0.05`` when ``N <= 1``).

    """
    moments = Moments()
    for xb in batches:
        moments.add(xb)
    return moments.default_lr(device)


def _merge_moments(
    n: int, mean: torch.Tensor | None, m2: torch.Tensor | None, device: torch.device
) -> float:
    d = _max_over_ranks(0 if mean is None else mean.numel(), device)
    zeros = torch.zeros(d, dtype=_F64, device=device)
    mean = zeros if mean is None else mean.to(device)
    m2 = zeros if m2 is None else m2.to(device)
    count = torch.tensor([float(n)], device=device, dtype=_F64)
    head = all_reduce_sum(torch.cat([count, n * mean]))
    total = int(head[0])
    if total <= 1:
        return 0.05
    g_mean = head[1:] / total
    g_m2 = all_reduce_sum(m2 + n * (mean - g_mean).square())
    std = (g_m2 / (total - 1)).sqrt().mean()
    return 0.05 * float(std.clamp_min(1e-8))


def _max_over_ranks(value: int, device: torch.device) -> int:
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
    flat = x.detach().reshape(-1).to(_F64)
    weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=_F64, device=flat.device)
    c = (flat * weights).sum()
    sums = all_reduce_sum(torch.stack([c, c * c]))
    spread = float(world_size() * sums[1] - sums[0] ** 2)
    if abs(spread) > 1e-10 * max(float(sums[0] ** 2), 1e-300):
        raise InvalidInputError(
            f"{name} differs between the ranks of the process group; pass the "
            "same tensor on every rank (e.g. broadcast it from rank 0)."
        )


def sync_gradient(
    loss: torch.Tensor, grad: torch.Tensor, b_local: int, n_global: int
) -> tuple[float, torch.Tensor, int]:
    """All-reduce a rank's partial objective and gradient; scale by ``N / b``.

    Parameters
    ----------
    loss : torch.Tensor
        This rank's unscaled batch sum (scalar; ``0`` for an empty part).
    grad : torch.Tensor
        Its gradient in ``Z`` (zeros for an empty part).
    b_local : int
        Inputs this rank evaluated.
    n_global : int
        Size ``N`` of the whole data set.

    Returns
    -------
    tuple
        ``(objective, gradient in Z's dtype, global batch size b)``; the
        objective and gradient are ``N / b`` times the sums over ranks.

    """
    parts = [loss.detach().reshape(1).to(_F64), grad.new_tensor([b_local], dtype=_F64)]
    buf = torch.cat([*parts, grad.detach().reshape(-1).to(_F64)])
    all_reduce_sum(buf)
    b = int(round(float(buf[1])))
    scale = n_global / b
    return float(buf[0]) * scale, (buf[2:] * scale).to(grad.dtype).view_as(grad), b
