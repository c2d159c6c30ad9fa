"""The one place where a kernel Gram matrix is factorised.

``jittered_cholesky`` factorises a Gram for a posterior; ``explained_trace`` is the
Nyström term ``Σₙ tr(Λₙ k(xₙ, Z) K_ZZ⁻¹ k(Z, xₙ))`` of the location objective with
a hand-written backward pass (two GEMMs instead of autograd through the Cholesky
factor and the triangular solves, which costs several ``(MC)³``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ._lapack import cholesky_in_place, solve_lower, solve_lower_transposed
from ._products import symmetric_product

__all__ = ["explained_trace", "jittered_cholesky"]


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
    return torch.linalg.cholesky(_jittered(K, jitter))


def _jittered(K: torch.Tensor, jitter: float, symmetrise: bool = True) -> torch.Tensor:
    """``½ (K + Kᵀ) + ε I`` (or ``K + ε I``), ``ε = jitter · mean(diag K)``."""
    _check_square_and_jitter(K, jitter)
    K = 0.5 * (K + K.T) if symmetrise else K.clone()
    tiny = torch.finfo(K.dtype).tiny
    scale = jitter * K.diagonal().mean().clamp_min(tiny)
    K.diagonal().add_(scale)
    return K


def _check_square_and_jitter(K: torch.Tensor, jitter: float) -> None:
    if jitter < 0:
        raise ValueError(f"jitter must be non-negative, got {jitter}.")
    if K.dim() != 2 or K.shape[0] != K.shape[1]:
        raise ValueError(f"K must be a square matrix, got shape {tuple(K.shape)}.")


def explained_trace(
    K_zz: torch.Tensor, K_zx: torch.Tensor, hessians: torch.Tensor, jitter: float
) -> torch.Tensor:
    """Weighted trace of the Nyström approximation, ``Σₙ tr(Λₙ Q_nn)``.

    ``Q = K_xz K̃_ZZ⁻¹ K_zx`` with ``K̃_ZZ = K_zz + ε I`` relatively jittered as in
    :func:`jittered_cholesky` (the jitter is part of the function). ``K_zz`` is
    taken to be symmetric (only its lower triangle is read, and the gradient
    returned for it is symmetric: the right one whenever ``K_zz`` is a symmetric
    function of what it depends on, as a Gram is); it is not symmetrised, which
    saves two passes over an ``(MC)²`` matrix per step.
    The backward pass is analytic: with ``A = K̃_ZZ⁻¹ K_zx`` the gradients are
    ``2 A Λ`` for ``K_zx`` and ``−A Λ Aᵀ`` for ``K̃_ZZ``, never the Cholesky
    backward pass. Forward: one Cholesky factorisation ``(MC)³/3`` and one
    triangular solve ``V = L⁻¹ K_zx`` (the value is ``Σ V ⊙ V Λ``); backward:
    one more solve ``A = L⁻ᵀ V`` and ``A Λ Aᵀ`` from its lower block triangle
    (:func:`._products.symmetric_product`), ``(MC)² b C`` flops each.

    Parameters
    ----------
    K_zz : torch.Tensor
        ``(M C, M C)`` Gram of the locations, symmetric PSD up to rounding
        (float64 recommended).
    K_zx : torch.Tensor
        ``(M C, b C)`` cross-Gram, columns input-major (``[m C + c, n C + e]``).
    hessians : torch.Tensor
        ``Λₙ`` ``(b, C, C)``, symmetric.
    jitter : float
        Relative diagonal jitter of ``K_zz``, non-negative.

    Returns
    -------
    torch.Tensor
        Scalar. Differentiable (once) with respect to ``K_zz``, ``K_zx`` and
        ``hessians``.

    Raises
    ------
    ValueError
        If the shapes do not fit together or ``jitter`` is negative.

    """
    b, C = hessians.shape[:2]
    if hessians.shape != (b, C, C) or K_zx.shape != (K_zz.shape[0], b * C):
        raise ValueError(
            f"Shapes do not fit: K_zz {tuple(K_zz.shape)}, K_zx {tuple(K_zx.shape)}, "
            f"hessians {tuple(hessians.shape)}; need (n, n), (n, b C), (b, C, C)."
        )
    _check_square_and_jitter(K_zz, jitter)  # before any work
    return _ExplainedTrace.apply(K_zz, K_zx, hessians, jitter)


class _ExplainedTrace(torch.autograd.Function):
    """``Σ V ⊙ (V Λ)``, ``V = L⁻¹ K_zx``, with the analytic backward pass.

    The jittered copy of ``K_zz`` is made here and factorised in place
    (:mod:`._lapack`); the jitter's own dependence on ``diag K_zz`` is added to
    the gradient: ``∂ε/∂K_ii = jitter / n``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        K_zz: torch.Tensor,
        K_zx: torch.Tensor,
        lam: torch.Tensor,
        jitter: float,
    ) -> torch.Tensor:
        K = _jittered(K_zz, jitter, symmetrise=False)  # our copy
        L = _cholesky_factor(K)
        V = solve_lower(L, K_zx)
        ctx.save_for_backward(L, V, K_zx, lam)
        ctx.jitter = jitter
        return (V * _times_blocks(V, lam)).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        L, V, K_zx, lam = ctx.saved_tensors
        A = solve_lower_transposed(L, V)  # K⁻¹ K_zx
        A_lam = _times_blocks(A, lam)
        g_K = g_zx = g_lam = None
        if ctx.needs_input_grad[0]:  # the factor scaled, not the (MC)² product
            g_K = symmetric_product(A, A_lam * -grad)
            g_K.diagonal().add_(ctx.jitter * g_K.diagonal().mean())
        if ctx.needs_input_grad[1]:
            g_zx = A_lam.mul_(2 * grad)
        if ctx.needs_input_grad[2]:
            n, (b, C) = L.shape[0], lam.shape[:2]
            X = torch.bmm(
                K_zx.reshape(n, b, C).permute(1, 2, 0),
                A.reshape(n, b, C).transpose(0, 1),
            )
            g_lam = grad * X
        return g_K, g_zx, g_lam, None


def _times_blocks(V: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``V Λ`` for ``V`` ``(n, b C)`` and block-diagonal ``Λ`` ``(b, C, C)``."""
    n, (b, C) = V.shape[0], lam.shape[:2]
    out = torch.bmm(V.reshape(n, b, C).transpose(0, 1), lam)
    return out.transpose(0, 1).reshape(n, b * C)


def _cholesky_factor(K: torch.Tensor) -> torch.Tensor:
    L, info = cholesky_in_place(K)
    if info != 0:
        raise torch.linalg.LinAlgError(
            "K_zz + jitter is not positive definite (leading minor "
            f"{info}); increase jitter or move coinciding locations apart."
        )
    return L
