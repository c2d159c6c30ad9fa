"""Matrix products of the structured NTK Grams (symmetric products, layer sums)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["layer_scale", "scaled_gram_sum", "symmetric_product"]


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


def layer_scale(
    a1: torch.Tensor, a2: torch.Tensor, weight: bool, bias: bool
) -> torch.Tensor:
    """One layer's input-side factor ``(B1, B2)`` of the structured NTK.

    ``a1 a2ᵀ`` (``+ 1`` with a bias) for a layer with a weight; ones for a layer
    with a bias only.

    Returns
    -------
    torch.Tensor
        ``(B1, B2)``.

    """
    if not weight:
        return a1.new_ones(a1.shape[0], a2.shape[0])
    s = a1 @ a2.T
    return s + 1.0 if bias else s


def scaled_gram_sum(
    terms: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
    shape: tuple[int, int, int, int],
    like: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``Σ_l S_l ⊙ Γ_l`` over the layers, in place, identity layers on the diagonal.

    Parameters
    ----------
    terms : iterable of (torch.Tensor, torch.Tensor or None)
        Per layer, the input-side scale ``S_l`` ``(B1, B2)`` and the signal Gram
        ``Γ_l`` ``(B1, C, B2, C)``; ``None`` for a layer whose signals are the
        identity (its term is ``S_l`` on the output diagonal). Consumed lazily,
        so only one new Gram is alive besides the sum.
    shape : tuple of int
        ``(B1, C, B2, C)``.
    like : torch.Tensor
        Any tensor of the wanted dtype and device (for an all-identity sum).

    Returns
    -------
    kernel : torch.Tensor
        ``(B1, C, B2, C)``.
    grams : list of (torch.Tensor or None)
        The ``Γ_l`` in layer order (kept for a backward pass).

    """
    kernel: torch.Tensor | None = None
    grams: list[torch.Tensor | None] = []
    diagonal = []
    for scale, gram in terms:
        grams.append(gram)
        if gram is None:
            diagonal.append(scale)
            continue
        s = scale[:, None, :, None]
        kernel = gram * s if kernel is None else kernel.addcmul_(s, gram)
    if kernel is None:
        kernel = like.new_zeros(shape)
    for scale in diagonal:
        kernel.diagonal(dim1=1, dim2=3).add_(scale[:, :, None])
    return kernel, grams
