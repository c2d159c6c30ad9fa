"""The one place where a kernel Gram matrix is factorised."""

from __future__ import annotations

import torch

__all__ = ["jittered_cholesky"]


def jittered_cholesky(K: torch.Tensor, jitter: float) -> torch.Tensor:
    """Cholesky factor of a symmetrised Gram with relative diagonal jitter.

    ``L Lᵀ = ½ (K + Kᵀ) + ε I`` with ``ε = jitter · mean(diag K)``: the jitter is
    relative, so it means the same for a prior precision of ``1e-4`` and of
    ``1e4``. ``ε`` is part of the function (it is not detached), so gradients with
    respect to whatever ``K`` depends on are the exact gradients of the jittered
    objective. A zero (or underflowing) diagonal is clamped to the dtype's smallest
    normal number, so an all-zero ``K`` still factorises.

    Parameters
    ----------
    K : torch.Tensor
        ``(n, n)``, symmetric positive semi-definite up to rounding; float64 is
        recommended (the callers in this package always pass float64).
    jitter : float
        Relative jitter, non-negative. The context posterior uses ``1e-8`` (with
        ``Z = X`` it reproduces the full-data Laplace to that accuracy); the
        location optimiser ``1e-6`` (its gradient in ``Z`` scales with the
        condition number of ``K_ZZ``, which the larger jitter bounds when two
        locations approach each other).

    Returns
    -------
    torch.Tensor
        Lower-triangular ``(n, n)``.

    Raises
    ------
    ValueError
        If ``jitter`` is negative or ``K`` is not a square matrix.

    """
    if jitter < 0:
        raise ValueError(f"jitter must be non-negative, got {jitter}.")
    if K.dim() != 2 or K.shape[0] != K.shape[1]:
        raise ValueError(f"K must be a square matrix, got shape {tuple(K.shape)}.")
    K = 0.5 * (K + K.T)
    tiny = torch.finfo(K.dtype).tiny
    scale = jitter * K.diagonal().mean().clamp_min(tiny)
    eye = torch.eye(K.shape[0], dtype=K.dtype, device=K.device)
    return torch.linalg.cholesky(K + scale * eye)
