"""Matrix products whose result is known to be symmetric."""

from __future__ import annotations

import torch

__all__ = ["symmetric_product"]


def symmetric_product(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A Bᵀ`` ``(n, n)`` for a symmetric result, from its lower block triangle.

    The rows are split into ``k <= 3`` blocks (about 384 rows or more each); the
    blocks ``i >= j`` are computed (``(k + 1) / 2k`` of the flops of the full
    product) and mirrored into the blocks above the diagonal. The caller
    guarantees that ``A Bᵀ`` is symmetric (e.g. ``B = A`` or ``B = A D`` with
    ``D`` diagonal); otherwise the upper blocks are wrong.

    Parameters
    ----------
    A, B : torch.Tensor
        ``(n, k)`` each.

    Returns
    -------
    torch.Tensor
        ``(n, n)``, contiguous.

    """
    n = A.shape[0]
    k = max(1, min(3, n // 384))
    if k == 1:
        return A @ B.T
    out = A.new_empty((n, n))
    edges = [round(i * n / k) for i in range(k + 1)]
    for r0, r1 in zip(edges[:-1], edges[1:]):
        torch.mm(A[r0:r1], B[:r1].T, out=out[r0:r1, :r1])
    for r0, r1 in zip(edges[1:-1], edges[2:]):
        out[:r0, r0:r1] = out[r0:r1, :r0].T
    return out
