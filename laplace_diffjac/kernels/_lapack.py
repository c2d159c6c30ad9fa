"""Cholesky factorisation and triangular solves without autograd, LAPACK on CPU.

The location optimiser factorises an ``(MC)²`` Gram and solves with it twice per
step inside a hand-written backward pass (:mod:`._cholesky`), so no autograd is
needed there. On CPU in float64 these calls go to SciPy's LAPACK and BLAS
(``dpotrf`` in place, ``dtrsm``), which skips the copies ``torch.linalg.cholesky_ex``
makes around ``potrf`` (into column-major order, then zeroing the upper triangle)
and, on the AMD EPYC machine of ``benchmarks/optimizer/OPTIMIZER.md``, ran ``potrf``
and ``trsm`` at ``n = 1260`` with 640 right-hand sides 1.8× and 1.1–1.5× faster than
PyTorch's MKL (single thread). That route is taken only when PyTorch runs on one
thread (``torch.set_num_threads(1)`` or ``OMP_NUM_THREADS=1``), with SciPy's BLAS
held to one thread too (through ``threadpoolctl``): with more threads a second
pool, OpenBLAS's, would compete with PyTorch's OpenMP pool for the same cores.
Measured with ``benchmarks/optimizer/optimizer_defaults.py threads`` (100 steps,
quiet 2-core machine): PyTorch's two threads plus OpenBLAS's two made a small problem
(M = 16) 8× slower in wall time than one thread (1.9 s against 0.23 s), 14× with
two busy processes beside it; with ``torch.linalg`` on PyTorch's own threads the
same run takes 0.30 s, and 20 steps on digits at M = 126 6.3 s against 8.7 s.
Elsewhere (CUDA, other dtypes, several threads) ``torch.linalg`` does the work.

A factor is a square tensor whose *lower triangle* holds ``L``; its strict upper
triangle is unspecified (SciPy leaves the input there) and never read.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager

import torch
from scipy.linalg import blas, lapack
from threadpoolctl import ThreadpoolController

__all__ = ["cholesky_in_place", "solve_lower", "solve_lower_transposed"]


@functools.cache
def _controller() -> ThreadpoolController:
    """The loaded BLAS libraries (SciPy's is imported above), inspected once."""
    return ThreadpoolController()


def _torch_threads() -> AbstractContextManager:
    """Context holding SciPy's BLAS to one thread (the route runs single-threaded)."""
    return _controller().limit(limits=1, user_api="blas")


def _lapack_applies(t: torch.Tensor) -> bool:
    """CPU float64 without a graph, with PyTorch on one thread (one pool only)."""
    return (
        t.device.type == "cpu"
        and t.dtype == torch.float64
        and not t.requires_grad
        and torch.get_num_threads() == 1
    )


def cholesky_in_place(K: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Factorise a symmetric positive definite ``K = L Lᵀ``, overwriting ``K``.

    Parameters
    ----------
    K : torch.Tensor
        ``(n, n)`` symmetric, owned by the caller (it is overwritten on CPU in
        float64; left as it was elsewhere).

    Returns
    -------
    L : torch.Tensor
        ``(n, n)``; its lower triangle is the factor.
    info : int
        ``0`` on success, else the order of the first non-positive leading minor.

    """
    if not (_lapack_applies(K) and K.is_contiguous()):
        L, info = torch.linalg.cholesky_ex(K)
        return L, int(info)
    # K is symmetric, so its row-major memory is also K in column-major order:
    # potrf writes L's columns there, i.e. L lies in the lower triangle of K.T
    with _torch_threads():
        _, info = lapack.dpotrf(K.numpy().T, lower=1, overwrite_a=1, clean=0)
    return K.T, int(info)


def solve_lower(L: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``L⁻¹ B`` for a factor ``L`` from :func:`cholesky_in_place`, ``B`` ``(n, k)``.

    Returns
    -------
    torch.Tensor
        ``(n, k)``.

    """
    return _solve(L, B, transpose=False)


def solve_lower_transposed(L: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``L⁻ᵀ B`` for a factor ``L`` from :func:`cholesky_in_place`, ``B`` ``(n, k)``.

    Returns
    -------
    torch.Tensor
        ``(n, k)``.

    """
    return _solve(L, B, transpose=True)


def _solve(L: torch.Tensor, B: torch.Tensor, transpose: bool) -> torch.Tensor:
    if not (_lapack_applies(L) and _lapack_applies(B) and L.mT.is_contiguous()):
        tri = L.mT if transpose else L
        return torch.linalg.solve_triangular(tri, B, upper=transpose)
    # with Bᵀ in column-major order: solve X op(L)ᵀ... as X Lᵀ = Bᵀ (L⁻¹ B) or
    # X L = Bᵀ (L⁻ᵀ B); X is column-major (k, n), i.e. the row-major result
    Bt = B.contiguous().numpy().T
    with _torch_threads():
        trans = int(not transpose)
        X = blas.dtrsm(1.0, L.numpy(), Bt, side=1, lower=1, trans_a=trans)
    return torch.from_numpy(X.T)
