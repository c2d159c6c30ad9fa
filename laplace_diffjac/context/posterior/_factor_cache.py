"""The factors of a fitted context posterior, kept between calls.

With one prior group (a scalar prior precision, ``G = 1``) the prior variance
``s`` and the likelihood factor ``h = 1 / (σ² T)`` only scale the whitened matrix
of :func:`._evidence.dtc_factor`: ``K_ZZ = s K₀`` (the jitter is relative, so
``L = √s L₀`` exactly) and ``K_ZX Λ K_XZ = s² h B₀``, hence::

    A(s, h) = L⁻¹ (h s² B₀) L⁻ᵀ = s h A₀,   A₀ = L₀⁻¹ B₀ L₀⁻ᵀ.

One eigendecomposition ``A₀ = U diag(α) Uᵀ`` then gives, for every ``(s, h)``,
``log det(I + A) = Σₖ log(1 + s h αₖ)``, ``tr A = s h Σₖ αₖ`` and the predictive
factor ``W = L⁻ᵀ U diag(√(eₖ / (1 + eₖ)))`` with ``eₖ = s h αₖ``, that is
``W = (L₀⁻ᵀ U) diag(√(h αₖ / (1 + s h αₖ)))``. A search over a scalar prior
precision (or ``σ``) then costs one ``(MC)³`` eigendecomposition instead of two
Cholesky factorisations and two triangular solves per evaluation, and the result
stays differentiable in ``s`` and ``h`` (the ``αₖ`` do not depend on them).

The cache is filled lazily and emptied by :meth:`FactorCache.clear` whenever the
sums change (``fit``, ``update``, ``load_state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._evidence import dtc_factor, raise_rank_error
from ._statistics import Accumulators

__all__ = ["FactorCache", "ScalarSpectrum"]


@dataclass(frozen=True)
class ScalarSpectrum:
    """Eigenpairs of ``A₀`` for one prior group (see the module docstring).

    Attributes
    ----------
    alpha : torch.Tensor
        ``(MC,)`` eigenvalues ``αₖ`` of ``A₀`` (float64).
    Y : torch.Tensor
        ``(MC, MC)`` ``L₀⁻ᵀ U``.
    jitter : float
        Relative jitter of ``K_ZZ`` they were computed with.

    """

    alpha: torch.Tensor
    Y: torch.Tensor
    jitter: float

    @staticmethod
    def of(acc: Accumulators, jitter: float) -> ScalarSpectrum:
        """Eigendecompose ``A₀`` (``s = h = 1``) of one-group sums."""
        one = torch.ones((), dtype=torch.float64, device=acc.K_zz.device)
        L, A = dtc_factor(acc, one.reshape(1), one, jitter)
        alpha, U = torch.linalg.eigh(A)
        Y = torch.linalg.solve_triangular(L.T, U, upper=True)
        return ScalarSpectrum(alpha, Y, jitter)

    def log_det_and_trace(
        self, s: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log det(I + A)`` and ``tr A`` at ``A = s h A₀``, differentiable in both.

        Returns
        -------
        log_det, trace : torch.Tensor
            ``()`` each.

        Raises
        ------
        torch.linalg.LinAlgError
            If ``I + A`` is not positive definite (rounding past the kernel's
            numerical rank), with the message of :func:`._evidence.raise_rank_error`.

        """
        e = s.reshape(()) * h * self.alpha
        if bool((1 + e.detach()).le(0).any()):
            raise_rank_error(int(e.shape[0]), self.jitter)
        return torch.log1p(e).sum(), e.sum()

    def factor(self, s: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The predictive factor ``W`` ``(MC, MC)`` at ``(s, h)`` (detached)."""
        a = (s.reshape(()) * h).detach() * self.alpha.clamp_min(0)
        return self.Y * torch.sqrt(h.detach() * self.alpha.clamp_min(0) / (1 + a))


class FactorCache:
    """Factors of the posterior's current sums: the scalar spectrum or keyed ``W``."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget every factor (the sums changed)."""
        self._spectrum: ScalarSpectrum | None = None
        self._W: torch.Tensor | None = None
        self._W_key: tuple | None = None
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
        if not _one_group(acc):
            return None
        key = (float(s.detach().reshape(())), float(h.detach()), jitter)
        seen, self._evidence_key = self._evidence_key, key
        if self._spectrum is None and seen is not None and seen != key:
            self._spectrum = ScalarSpectrum.of(acc, jitter)
        return self._spectrum if self._matches(jitter) else None

    def prediction_factor(
        self, acc: Accumulators, s: torch.Tensor, h: torch.Tensor, jitter: float
    ) -> torch.Tensor:
        """``W`` with ``W Wᵀ = K_ZZ⁻¹ − (K_ZZ + K_ZX Λ K_XZ)⁻¹`` at ``(s, h)``."""
        s, h = s.detach(), h.detach()
        if _one_group(acc):
            if not self._matches(jitter):
                self._spectrum = ScalarSpectrum.of(acc, jitter)
            assert self._spectrum is not None
            return self._spectrum.factor(s, h)
        key = (tuple(s.tolist()), float(h), jitter)
        if self._W is None or self._W_key != key:
            L, A = dtc_factor(acc, s, h, jitter)
            ev, U = torch.linalg.eigh(A)
            ev = ev.clamp_min(0)
            self._W = torch.linalg.solve_triangular(
                L.T, U * torch.sqrt(ev / (1 + ev)), upper=True
            )
            self._W_key = key
        return self._W

    def _matches(self, jitter: float) -> bool:
        return self._spectrum is not None and self._spectrum.jitter == jitter


def _one_group(acc: Accumulators) -> bool:
    """One prior group and sums without a graph (the spectrum is detached)."""
    graph = acc.K_zz.requires_grad or acc.B.requires_grad
    return acc.K_zz.shape[0] == 1 and not graph
