"""The linearised-Laplace evidence seen through context locations, and its bound.

The GGN Laplace evidence of laplace-torch (``FullLaplace.log_marginal_likelihood``)
is, with ``G = Σₙ Jₙᵀ Λₙ Jₙ`` and the prior ``N(μ₀, Σ₀)``::

    log Z = log p(y | θ*) − ½ (θ* − μ₀)ᵀ Σ₀⁻¹ (θ* − μ₀)
            − ½ log det(I + Σ₀^{½} G Σ₀^{½}).

By Sylvester's identity ``log det(I + Σ₀^{½} G Σ₀^{½}) = log det(I + Λ^{½} K_XX Λ^{½})``
with ``K = J Σ₀ Jᵀ`` and ``Λ = blockdiag(Λₙ)``. With locations ``Z`` write
``K_XX = Q_XX + E``, ``Q_XX = K_XZ K_ZZ⁻¹ K_ZX`` and ``E ⪰ 0`` (a Schur complement;
with a jittered ``K_ZZ + εI`` the ``Q`` only gets smaller, so ``E ⪰ 0`` still).
``log det`` is concave on positive definite matrices, so its first-order expansion
around ``I + Λ^{½} Q Λ^{½}`` is an upper bound::

    log det(I + Λ^{½}(Q + E)Λ^{½})
        ≤ log det(I + Λ^{½}QΛ^{½}) + tr((I + Λ^{½}QΛ^{½})⁻¹ Λ^{½}EΛ^{½})
        ≤ log det(I + Λ^{½}QΛ^{½}) + tr(ΛE)          [(I + ·)⁻¹ ⪯ I, Λ^{½}EΛ^{½} ⪰ 0]

and ``tr(ΛE) = Σₙ tr(Λₙ (k(xₙ, xₙ) − Q(xₙ, xₙ)))`` since ``Λ`` is block diagonal
(Titsias's trace term, weighted by the likelihood curvature). Hence::

    log Z ≥ log p(y | θ*) − ½ scatter − ½ log det(I + L⁻¹ K_ZX Λ K_XZ L⁻ᵀ)
            − ½ Σₙ tr(Λₙ (kₙₙ − Qₙₙ)),     K_ZZ = L Lᵀ,

for *every* ``Z`` (Sylvester again turns the ``N C``-sized determinant into the
``M C``-sized one). With ``Z = X`` and ``K_XX`` invertible, ``E = 0`` and both
inequalities are equalities: the bound is the full-data GGN evidence. Both terms
come from the accumulators: ``A = L⁻¹ (h B) L⁻ᵀ`` with ``h = 1 / (σ² T)`` gives
the determinant, and ``Σₙ tr(Λₙ Qₙₙ) = tr(K_ZZ⁻¹ K_ZX Λ K_XZ) = tr(A)``,
``Σₙ tr(Λₙ kₙₙ) = h Σ_p Σ₀_p d_p``.

Everything here is differentiable in the group prior variances, ``h`` (so ``σ``
and ``T``) and, through :func:`._evidence_gradient.evidence_loss_backward`, in
the locations.
"""

from __future__ import annotations

import math
from typing import NoReturn, Protocol

import torch

from ...kernels import jittered_cholesky
from ._statistics import Accumulators

__all__ = ["dtc_factor", "evidence_terms", "log_det_eye_plus", "log_likelihood"]


def log_det_eye_plus(A: torch.Tensor, jitter: float) -> torch.Tensor:
    """``log det(I + A)`` for the whitened ``A`` (PSD in exact arithmetic).

    ``A = L⁻¹ B L⁻ᵀ`` is formed from ``B = K_ZX Λ K_XZ``, so rounding in ``B``
    (relative to its largest entry) is amplified by ``1 / (jitter · mean diag
    K_ZZ)`` in the directions where ``K_ZZ`` is nearly singular: once the ``MC``
    locations exceed the kernel's numerical rank, ``A`` can lose definiteness.
    Then the bound is dominated by rounding; say so instead of a bare failure.

    Parameters
    ----------
    A : torch.Tensor
        ``(MC, MC)`` float64, symmetric.
    jitter : float
        The relative jitter used for ``K_ZZ`` (for the message).

    Returns
    -------
    torch.Tensor
        ``()``.

    Raises
    ------
    torch.linalg.LinAlgError
        If ``I + A`` is not positive definite (a ``RuntimeError``; the message
        names the fix: a larger ``jitter`` or fewer locations).

    """
    eye = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    chol, info = torch.linalg.cholesky_ex(eye + A)
    if bool(info.detach().ne(0).any()):
        raise_rank_error(A.shape[0], jitter)
    return 2 * chol.diagonal().log().sum()


def raise_rank_error(n: int, jitter: float) -> NoReturn:
    """Raise the error for an ``I + A`` that rounding made indefinite (``n = MC``).

    Raises
    ------
    torch.linalg.LinAlgError
        Always, naming the fix: a larger ``jitter`` or fewer locations.

    """
    raise torch.linalg.LinAlgError(
        f"The evidence bound lost positive definiteness to rounding (jitter="
        f"{jitter:g}): its M·C = {n} location outputs exceed the "
        "numerical rank of the kernel at this prior precision and noise. Pass "
        "a larger jitter (e.g. jitter=1e-6) or use fewer locations."
    )


def dtc_factor(
    acc: Accumulators, s: torch.Tensor, h: torch.Tensor, jitter: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``L`` (``K_ZZ = L Lᵀ``) and ``A = L⁻¹ K_ZX Λ K_XZ L⁻ᵀ``, both ``(MC, MC)``.

    Parameters
    ----------
    acc : Accumulators
        The sums of ``fit``.
    s : torch.Tensor
        ``(G,)`` group prior-variance scales.
    h : torch.Tensor
        ``()`` likelihood factor ``1 / (σ² T)``.
    jitter : float
        Relative jitter of ``K_ZZ``.

    Returns
    -------
    L, A : torch.Tensor
        Float64.

    """
    s = s.to(torch.float64)
    K_zz = torch.einsum("g,gij->ij", s, acc.K_zz)
    B = torch.einsum("g,h,ghij->ij", s, s, acc.symmetrised_B()) * h
    L = jittered_cholesky(K_zz, jitter)
    A = torch.linalg.solve_triangular(L, B, upper=False)
    A = torch.linalg.solve_triangular(L, A.mT, upper=False)
    return L, 0.5 * (A + A.mT)


class Spectrum(Protocol):
    """``log det(I + A)`` and ``tr A`` for any ``(s, h)`` (one prior group)."""

    def log_det_and_trace(
        self, s: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def evidence_terms(
    acc: Accumulators,
    s: torch.Tensor,
    prior_var: torch.Tensor,
    h: torch.Tensor,
    jitter: float,
    spectrum: Spectrum | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log det(I + A)`` and the trace correction ``Σₙ tr(Λₙ (kₙₙ − Qₙₙ))``.

    Parameters
    ----------
    acc : Accumulators
        The sums of ``fit``.
    s : torch.Tensor
        ``(G,)`` group prior-variance scales.
    prior_var : torch.Tensor
        ``(P,)`` per-parameter prior variance ``Σ₀`` (consistent with ``s``).
    h : torch.Tensor
        ``()`` likelihood factor ``1 / (σ² T)``.
    jitter : float
        Relative jitter of ``K_ZZ``.
    spectrum : Spectrum, optional
        Eigenvalues of the one-group whitened matrix
        (:class:`._factor_cache.ScalarSpectrum`): no factorisation here.

    Returns
    -------
    log_det, trace : torch.Tensor
        ``()`` each; their sum bounds ``log det(I + Σ₀^{½} G Σ₀^{½})`` from above.

    Raises
    ------
    torch.linalg.LinAlgError
        If rounding made ``I + A`` indefinite (see :func:`log_det_eye_plus`).

    """
    if spectrum is not None:
        log_det, trace_A = spectrum.log_det_and_trace(s, h)
    else:
        _, A = dtc_factor(acc, s, h, jitter)
        log_det, trace_A = log_det_eye_plus(A, jitter), A.diagonal().sum()
    trace = h * (prior_var.to(torch.float64) * acc.ggn_diag).sum() - trace_A
    return log_det, trace


def log_likelihood(
    acc: Accumulators,
    likelihood: str,
    sigma_noise: torch.Tensor,
    temperature: float,
    n_outputs: int,
) -> torch.Tensor:
    """laplace-torch's ``log_likelihood`` at the MAP from the accumulated loss.

    Parameters
    ----------
    acc : Accumulators
        The sums of ``fit``.
    likelihood : {'regression', 'classification'}
        The likelihood.
    sigma_noise : torch.Tensor
        ``()`` observation noise (regression).
    temperature : float
        Likelihood temperature.
    n_outputs : int
        ``C``.

    Returns
    -------
    torch.Tensor
        ``()``: ``−loss / (σ² T) − N C log(σ √(2π))`` (regression) or
        ``−loss / T`` (classification), as laplace-torch.

    Raises
    ------
    ValueError
        If ``fit`` saw no targets.

    """
    if not acc.has_targets:
        raise ValueError(
            "The evidence needs the training targets: call fit with a loader of "
            "(x, y) batches or a tuple (x, y) whose y are (N, C) regression targets "
            "or (N,) class indices (fit got inputs only or other targets)."
        )
    sigma = sigma_noise.to(torch.float64)
    if likelihood == "regression":
        norm = acc.n_data * n_outputs * torch.log(sigma * math.sqrt(2 * math.pi))
        return -acc.loss / (sigma.square() * temperature) - norm
    return -acc.loss / temperature
