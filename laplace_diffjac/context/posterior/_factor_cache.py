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
``ωₖ`` do not depend on them). Other priors, or a jitter changed after ``fit``,
go through :class:`._evidence.Frame` and one eigendecomposition per value.

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
    """``Σ** = K** − V Vᵀ`` with ``V = (R⁻¹ T)ᵀ F``, ``T = L₀⁻¹ K_Z*``.

    Attributes
    ----------
    frame : Frame
        The whitening of ``K_ZZ`` at the current prior.
    F : torch.Tensor
        ``(MC, MC)`` ``U diag(√(eₖ / (1 + eₖ)))`` from ``A = U diag(e) Uᵀ``.
    H : torch.Tensor
        ``(MC, MC)`` ``U diag(1 / √(1 + eₖ))``, so ``(I + A)⁻¹ = H Hᵀ``.

    """

    frame: Frame
    F: torch.Tensor
    H: torch.Tensor

    def project(self, T: torch.Tensor) -> torch.Tensor:
        """``V`` ``(n, MC)`` for the whitened cross-covariances ``T`` ``(MC, n)``."""
        return self.frame.whiten(T).mT @ self.F


def _factor_of(frame: Frame, e: torch.Tensor, U: torch.Tensor) -> PredictiveFactor:
    e = e.clamp_min(0)
    return PredictiveFactor(frame, U * torch.sqrt(e / (1 + e)), U / torch.sqrt(1 + e))


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
        """The factor of ``K_ZZ⁻¹ − (K_ZZ + K_ZX Λ K_XZ)⁻¹`` at ``(s, h)``."""
        s, h = s.detach(), h.detach()
        if _one_group(acc, jitter):
            if self._spectrum is None:
                self._spectrum = ScalarSpectrum.of(acc)
            return self._spectrum.factor(s, h)
        key = (tuple(s.tolist()), float(h), jitter)
        if self._factor is None or self._factor_key != key:
            frame, A = whitened_matrix(acc, s, h, jitter)
            e, U = torch.linalg.eigh(A)
            self._factor = _factor_of(frame, e, U)
            self._factor_key = key
        return self._factor


def _one_group(acc: Accumulators, jitter: float) -> bool:
    """One prior group at the fit's jitter, sums without a graph."""
    graph = acc.C.requires_grad or acc.W.requires_grad
    return len(acc.bounds) == 1 and jitter == acc.jitter and not graph
