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
come from the whitened sums (:mod:`._statistics`): with
``K_ZZ(s) + ε(s) I = L₀ R Rᵀ L₀ᵀ`` (:class:`Frame`) and ``h = 1 / (σ² T)``,
``A = h R⁻¹ (Σ_{g,h} s_g s_h W^{gh}) R⁻ᵀ`` gives the determinant (its
eigenvalues are ``≥ 0``, so ``I + A`` is factorised without loss), and
``Σₙ tr(Λₙ Qₙₙ) = tr(K_ZZ⁻¹ K_ZX Λ K_XZ) = tr(A)``, ``Σₙ tr(Λₙ kₙₙ) = h Σ_p Σ₀_p d_p``.
For one prior group at the fit's jitter ``R = √s I`` and ``A = s h W``: a new
scalar prior precision, ``σ`` or temperature only rescales.

Everything here is differentiable in the group prior variances, ``h`` (so ``σ``
and ``T``) and, through :func:`._evidence_gradient.evidence_loss_backward`, in
the locations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn, Protocol

import torch

from ._statistics import Accumulators

__all__ = [
    "Frame",
    "evidence_terms",
    "frame_of",
    "log_det_eye_plus",
    "log_likelihood",
    "whitened_matrix",
]


def log_det_eye_plus(A: torch.Tensor, jitter: float) -> torch.Tensor:
    """``log det(I + A)`` for the whitened ``A`` (PSD up to rounding).

    ``A`` is a sum of whitened, PSD batch terms, so ``I + A`` has eigenvalues of at
    least one up to rounding of order ``1e-16 ‖A‖``; its Cholesky factorisation
    fails only if something upstream is not finite.

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
        If ``I + A`` is not positive definite.

    """
    eye = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    chol, info = torch.linalg.cholesky_ex(eye + A)
    if bool(info.detach().ne(0).any()):
        raise_rank_error(A.shape[0], jitter)
    return 2 * chol.diagonal().log().sum()


def raise_rank_error(n: int, jitter: float) -> NoReturn:
    """Raise the error for an ``I + A`` that is not positive definite (``n = MC``).

    Raises
    ------
    torch.linalg.LinAlgError
        Always, naming what to check.

    """
    raise torch.linalg.LinAlgError(
        f"The evidence bound's I + A ({n} location outputs, jitter={jitter:g}) is "
        "not positive definite: the model's outputs or Jacobians at the data or "
        "the locations are not finite, or the prior precision or noise is not "
        "positive. Check them, or pass a larger jitter."
    )


@dataclass(frozen=True)
class Frame:
    """``K_ZZ(s) + ε(s) I = L₀ R Rᵀ L₀ᵀ`` at group prior variances ``s``.

    ``R = √scale · I`` when ``scale`` is set (one group at the fit's jitter: exact),
    else the Cholesky factor ``R`` of ``M = L₀⁻¹ (K_ZZ(s) + ε(s) I) L₀⁻ᵀ``.

    Attributes
    ----------
    L0 : torch.Tensor
        ``(MC, MC)`` the fit's frame factor.
    scale : torch.Tensor or None
        ``()`` the prior variance of the one group.
    R : torch.Tensor or None
        ``(MC, MC)`` lower-triangular.

    """

    L0: torch.Tensor
    scale: torch.Tensor | None
    R: torch.Tensor | None

    def whiten(self, T: torch.Tensor) -> torch.Tensor:
        """``R⁻¹ T`` for ``T = L₀⁻¹ K_Z*`` ``(MC, n)`` (differentiable in ``T``)."""
        if self.scale is not None:
            return T / self.scale.sqrt()
        assert self.R is not None
        return torch.linalg.solve_triangular(self.R, T, upper=False)

    def inner(self, X: torch.Tensor) -> torch.Tensor:
        """``R⁻¹ X R⁻ᵀ`` for a symmetric ``X`` ``(MC, MC)``, made symmetric."""
        if self.scale is not None:
            return X / self.scale
        assert self.R is not None
        Y = torch.linalg.solve_triangular(self.R, X, upper=False)
        Y = torch.linalg.solve_triangular(self.R, Y.mT, upper=False)
        return 0.5 * (Y + Y.mT)


def frame_of(acc: Accumulators, s: torch.Tensor, jitter: float) -> Frame:
    """The :class:`Frame` of ``K_ZZ(s)`` with relative ``jitter``.

    One group at the fit's jitter is exact (``K_ZZ(s) + ε(s) I = s L₀ L₀ᵀ``).
    Otherwise ``M = Σ_g s_g C^g + ε(s) L₀⁻¹ L₀⁻ᵀ`` is formed from the whitened
    group Grams ``C^g = G^g G^gᵀ`` (products of the whitened Jacobians, so
    positive semi-definite and well scaled) and factorised; it does not depend on
    the data or its batching.

    Parameters
    ----------
    acc : Accumulators
        The sums of ``fit``.
    s : torch.Tensor
        ``(G,)`` group prior-variance scales (differentiable).
    jitter : float
        Relative jitter of ``K_ZZ``.

    Returns
    -------
    Frame

    Raises
    ------
    torch.linalg.LinAlgError
        If ``M`` is not positive definite (a non-positive prior variance).

    """
    s = s.to(torch.float64)
    if len(acc.bounds) == 1 and jitter == acc.jitter:
        return Frame(acc.L0, s.reshape(()), None)
    L0 = acc.L0
    eye = torch.eye(L0.shape[0], dtype=L0.dtype, device=L0.device)
    inv = torch.linalg.solve_triangular(L0, eye, upper=False)
    mean_diag = torch.einsum("g,gi->", s, acc.K_diag) / L0.shape[0]
    eps = jitter * mean_diag.clamp_min(torch.finfo(L0.dtype).tiny)
    M = torch.einsum("g,gij->ij", s, acc.group_grams()) + eps * (inv @ inv.mT)
    M = 0.5 * (M + M.mT)
    R, info = torch.linalg.cholesky_ex(M)
    if bool(info.detach().ne(0).any()):
        raise torch.linalg.LinAlgError(
            "K_ZZ at this prior precision is not positive definite; prior "
            "precisions must be positive and finite."
        )
    return Frame(L0, None, R)


def whitened_matrix(
    acc: Accumulators, s: torch.Tensor, h: torch.Tensor, jitter: float
) -> tuple[Frame, torch.Tensor]:
    """The frame and ``A = h R⁻¹ (Σ s_g s_h W^{gh}) R⁻ᵀ`` ``(MC, MC)``.

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
    frame : Frame
    A : torch.Tensor
        Float64, symmetric.

    """
    s = s.to(torch.float64)
    frame = frame_of(acc, s, jitter)
    W = torch.einsum("g,h,ghij->ij", s, s, acc.symmetrised_W())
    return frame, h * frame.inner(W)


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
        If ``I + A`` is not positive definite (see :func:`log_det_eye_plus`).

    """
    if spectrum is not None:
        log_det, trace_A = spectrum.log_det_and_trace(s, h)
    else:
        _, A = whitened_matrix(acc, s, h, jitter)
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
