"""The factors of a fitted context posterior, kept between calls.

With one prior group (a scalar prior precision, ``G = 1``) at the fit's jitter
the prior variance ``s`` and the likelihood factor ``h = 1 / (σ² T)`` only scale
the whitened matrix of :func:`._evidence.whitened_matrix`: ``A(s, h) = s h W``
with ``W`` the whitened sums of ``fit``. One eigendecomposition
``W = U diag(ω) Uᵀ`` then gives, for every ``(s, h)``,
``log det(I + A) = Σₖ log(1 + s h ωₖ)``, ``tr A = s h Σₖ ωₖ``, and the predictive
covariance ``Σ** = K** − vᵀ U diag(eₖ / (1 + eₖ)) Uᵀ v`` with ``eₖ = s h ωₖ`` and
``v = R⁻¹ L₀⁻¹ K_Z*`` (:class:`PredictiveFactor`). A search over a scalar prior
precision (or ``σ``) costs one ``(MC)³`` eigendecomposition instead of a Cholesky
factorisation per evaluation, and stays differentiable in ``s`` and ``h`` (the
``ωₖ`` do not depend on them).

The eigendecomposition costs 8–25 times a Cholesky factorisation and inverse of
the same matrix (``MC = 1280``, float64, 2 cores), so it is built only once a
second ``(s, h)`` is asked for (a search has started), by the evidence or by a
prediction. Until then, and for other priors or
a jitter changed after ``fit`` (through :class:`._evidence.Frame`, one
factorisation per value), predictions use the Cholesky factor
``I + A = C Cᵀ``: ``Σ** = K** − vᵀv + (C⁻¹v)ᵀ(C⁻¹v)``, since
``A (I + A)⁻¹ = I − (I + A)⁻¹``.

The cache is filled lazily and emptied by :meth:`FactorCache.clear` whenever the
sums change (``fit``, ``update``, ``load_state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._evidence import Frame, whitened_matrix
from ._statistics import Accumulators

__all__ = ["FactorCache", "PredictiveFactor", "ScalarSpectrum"]


@dataclass(frozen=True)
class PredictiveFactor:
    """``Σ** = K** − vᵀ (I − H Hᵀ) v`` with ``v = R⁻¹ T``, ``T = L₀⁻¹ K_Z*``.

    Attributes
    ----------
    frame : Frame
        The whitening of ``K_ZZ`` at the current prior.
    H : torch.Tensor
        ``(MC, MC)`` with ``(I + A)⁻¹ = H Hᵀ``: ``U diag(1 / √(1 + eₖ))`` from
        ``A = U diag(e) Uᵀ``, or ``C⁻ᵀ`` from ``I + A = C Cᵀ``.
    F : torch.Tensor or None
        ``(MC, MC)`` ``U diag(√(eₖ / (1 + eₖ)))`` with ``F Fᵀ = I − (I + A)⁻¹``
        from an eigendecomposition; ``None`` for a Cholesky factor, whose
        reduction is the difference of two Grams (:meth:`project`).

    """

    frame: Frame
    H: torch.Tensor
    F: torch.Tensor | None = None

    def project(self, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(V, W)`` with ``K** − Σ** = V Vᵀ − W Wᵀ`` for ``T`` ``(MC, n)``.

        Returns
        -------
        V : torch.Tensor
            ``(n, MC)``.
        W : torch.Tensor or None
            ``(n, MC)``, or ``None`` (eigendecomposition: ``V Vᵀ`` alone).

        """
        v = self.frame.whiten(T).mT
        if self.F is not None:
            return v @ self.F, None
        return v, v @ self.H


def _factor_of(frame: Frame, e: torch.Tensor, U: torch.Tensor) -> PredictiveFactor:
    e = e.clamp_min(0)
    return PredictiveFactor(frame, U / torch.sqrt(1 + e), U * torch.sqrt(e / (1 + e)))


def _cholesky_factor_of(frame: Frame, A: torch.Tensor) -> PredictiveFactor:
    """The factor from ``I + A = C Cᵀ`` (``A`` symmetric positive semi-definite)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    C = torch.linalg.cholesky(eye + A)
    C_inv = torch.linalg.solve_triangular(C, eye, upper=False)
    return PredictiveFactor(frame, C_inv.mT)


@dataclass(frozen=True)
class ScalarSpectrum:
    """Eigenpairs of the whitened sums ``W`` of one prior group.

    Attributes
    ----------
    omega : torch.Tensor
        ``(MC,)`` eigenvalues ``ωₖ`` of ``W`` (float64).
    U : torch.Tensor
        ``(MC, MC)`` eigenvectors.
    L0 : torch.Tensor
        ``(MC, MC)`` the fit's frame factor.

    """

    omega: torch.Tensor
    U: torch.Tensor
    L0: torch.Tensor

    @staticmethod
    def of(acc: Accumulators) -> ScalarSpectrum:
        """Eigendecompose ``W`` of one-group sums."""
        omega, U = torch.linalg.eigh(acc.symmetrised_W()[0, 0])
        return ScalarSpectrum(omega, U, acc.L0)

    def log_det_and_trace(
        self, s: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log det(I + A)`` and ``tr A`` at ``A = s h W``, differentiable in both.

        Returns
        -------
        log_det, trace : torch.Tensor
            ``()`` each.

        """
        e = s.reshape(()) * h * self.omega.clamp_min(0)
        return torch.log1p(e).sum(), e.sum()

    def factor(self, s: torch.Tensor, h: torch.Tensor) -> PredictiveFactor:
        """The predictive factor at ``(s, h)`` (detached)."""
        s = s.detach().reshape(())
        e = s * h.detach() * self.omega
        return _factor_of(Frame(self.L0, s, None), e, self.U)


class FactorCache:
    """Factors of the posterior's current sums: the scalar spectrum or keyed ones."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget every factor (the sums changed)."""
        self._spectrum: ScalarSpectrum | None = None
        self._factor: PredictiveFactor | None = None
        self._factor_key: tuple | None = None
        self._evidence_key: tuple | None = None

    def evidence_spectrum(
        self, acc: Accumulators, s: torch.Tensor, h: torch.Tensor, jitter: float
    ) -> ScalarSpectrum | None:
        """The spectrum for the evidence at ``(s, h)``, or ``None``: use Cholesky.

        It is built when a one-group evidence is asked for at a second ``(s, h)``
        (a search has started) and reused while the sums and jitter stay.

        Returns
        -------
        ScalarSpectrum or None
        """
        if not _one_group(acc, jitter):
            return None
        key = (float(s.detach().reshape(())), float(h.detach()))
        seen, self._evidence_key = self._evidence_key, key
        if self._spectrum is None and seen is not None and seen != key:
            self._spectrum = ScalarSpectrum.of(acc)
        return self._spectrum

    def prediction_factor(
        self, acc: Accumulators, s: torch.Tensor, h: torch.Tensor, jitter: float
    ) -> PredictiveFactor:
        """The factor of ``K_ZZ⁻¹ − (K_ZZ + K_ZX Λ K_XZ)⁻¹`` at ``(s, h)``.

        The scalar spectrum's if it exists, or is built now because this is the
        second ``(s, h)`` of a one-group posterior; otherwise a Cholesky factor,
        kept for this ``(s, h)``.

        Returns
        -------
        PredictiveFactor
            Detached from ``s`` and ``h``.

        """
        s, h = s.detach(), h.detach()
        key = (tuple(s.tolist()), float(h), jitter)
        if _one_group(acc, jitter):
            seen = self._factor_key
            if self._spectrum is None and seen is not None and seen != key:
                self._spectrum = ScalarSpectrum.of(acc)
            if self._spectrum is not None:
                return self._spectrum.factor(s, h)
        if self._factor is None or self._factor_key != key:
            frame, A = whitened_matrix(acc, s, h, jitter)
            self._factor = _cholesky_factor_of(frame, A)
            self._factor_key = key
        return self._factor


def _one_group(acc: Accumulators, jitter: float) -> bool:
    """One prior group at the fit's jitter, sums without a graph."""
    graph = acc.C.requires_grad or acc.W.requires_grad
    return len(acc.bounds) == 1 and jitter == acc.jitter and not graph
