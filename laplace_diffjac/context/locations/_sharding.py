"""The optimiser's quantities over the shards of a process group: lr and gradient.

Every function here works on the calling rank's shard and combines the ranks'
contributions with :func:`~laplace_diffjac.data.all_reduce_sum`; without a process
group it is the single-process computation.
"""

from __future__ import annotations

import torch

from ...data import all_reduce_sum, max_over_ranks

__all__ = ["Moments", "sync_gradient"]

_F64 = torch.float64


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


def _merge_moments(
    n: int, mean: torch.Tensor | None, m2: torch.Tensor | None, device: torch.device
) -> float:
    d = max_over_ranks(0 if mean is None else mean.numel(), device)
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
