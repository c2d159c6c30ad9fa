"""The dual mean: the linearised network's GP posterior mean through the locations.

With the linearised network ``f_lin(x; θ) = f*(x) + J(x)(θ − θ*)`` and the prior
``θ ~ N(μ₀, Σ₀)``, ``f_lin`` is a GP with mean ``m(x) = f*(x) + J(x)(μ₀ − θ*)``
and kernel ``K = J Σ₀ Jᵀ``. The Laplace (second-order) approximation of each
likelihood term at ``f*ₙ = f(xₙ; θ*)`` is a Gaussian site with precision
``βₙ = h Λ̃ₙ`` (the GGN likelihood Hessian, ``h = 1 / (σ² T)``) and pseudo-target
``ỹₙ = f*ₙ + βₙ⁻¹ gₙ``, ``gₙ = h g̃ₙ`` the likelihood's gradient in ``f``
(SFR's dual parameters ``αₙ = gₙ``, ``βₙ``; Scannell et al., 2024). Through the
locations (DTC) the posterior mean is::

    μ(x) = m(x) + K_xZ (K_ZZ + K_ZX β K_XZ)⁻¹ Σₙ K_Zn βₙ (ỹₙ − m(xₙ))
         = f*(x) − J(x) δ + K_xZ (K_ZZ + K_ZX β K_XZ)⁻¹ Σₙ K_Zn h (Λ̃ₙ Jₙ δ + g̃ₙ),

``δ = θ* − μ₀``, with no inverse of ``βₙ`` (singular for a softmax). In the
whitened frame (:mod:`._statistics`) the last term is ``Tₓᵀ (I + A)⁻¹ t`` with
``Tₓ = R⁻¹ L₀⁻¹ K_Zx`` and ``t = R⁻¹ L₀⁻¹ Σₙ K_Zn h r̃ₙ = h R⁻¹ Σ_g s_g u^g``.

**On the data of the fit it is the network.** With ``Z = X`` the DTC is exact,
and the last term is ``J(x) Σ (Jᵀ β J δ + Jᵀ g)`` with ``Σ = (Σ₀⁻¹ + Jᵀ β J)⁻¹``;
at a MAP of the same prior ``Jᵀ g = Σ₀⁻¹ δ`` (stationarity), so it is
``J(x) δ`` and ``μ(x) = f*(x)``: laplace-torch's GLM mean. With ``M < N`` it is
that up to the DTC's error; after ``update(x, y)`` it moves towards the new
targets (one Gauss-Newton step of the linearised network, in function space),
which the network's own output cannot.
"""

from __future__ import annotations

import torch

from ._factor_cache import PredictiveFactor
from ._features import BatchFeatures
from ._statistics import Accumulators

__all__ = ["check_predictive_mean", "dual_mean"]


def check_predictive_mean(predictive_mean: str) -> str:
    """``predictive_mean`` if it is ``'network'`` or ``'dual'``.

    Returns
    -------
    str

    Raises
    ------
    ValueError
        Naming the two choices.

    """
    if predictive_mean not in ("network", "dual"):
        raise ValueError(
            "predictive_mean must be 'network' (laplace-torch's GLM mean) or "
            f"'dual' (the linearised GP's posterior mean); got {predictive_mean!r}."
        )
    return predictive_mean


def dual_mean(
    acc: Accumulators,
    factor: PredictiveFactor,
    T: torch.Tensor,
    features: BatchFeatures,
    offset: torch.Tensor,
    s: torch.Tensor,
    h: torch.Tensor,
) -> torch.Tensor:
    """``μ(x)`` at test inputs (see the module docstring), ``(B*, C)`` float64.

    Parameters
    ----------
    acc : Accumulators
        The sums of ``fit`` (with ``u``).
    factor : PredictiveFactor
        The posterior's factor at ``(s, h)``.
    T : torch.Tensor
        ``L₀⁻¹ K_Z*`` ``(MC, B* C)``.
    features : BatchFeatures
        The network's outputs ``(B*, C)`` and Jacobians (or their factors) at the
        test inputs.
    offset : torch.Tensor
        ``(P,)`` ``θ* − μ₀``.
    s : torch.Tensor
        ``(G,)`` group prior variances.
    h : torch.Tensor
        ``()`` likelihood factor.

    Returns
    -------
    torch.Tensor
        ``(B*, C)``.

    Raises
    ------
    ValueError
        If ``fit`` (or an ``update``) had no targets, or the network's parameters
        or the prior mean changed since ``fit`` (the linearisation point).

    """
    if not acc.has_targets or acc.offset is None:
        raise ValueError(
            "predictive_mean='dual' needs the training targets: fit (and update) "
            "with (x, y) data."
        )
    if not torch.equal(offset, acc.offset):
        raise ValueError(
            "The prior mean or the network's parameters changed since fit; the dual "
            "mean is linearised there: call fit again."
        )
    u = torch.einsum("g,gi->i", s.to(torch.float64).detach(), acc.u)
    t = factor.frame.whiten((h.detach() * u).unsqueeze(1))  # (MC, 1)
    Tx = factor.frame.whiten(T)  # (MC, B* C)
    correction = (Tx.mT @ factor.H) @ (factor.H.mT @ t)
    f = features.f
    return f - features.jvp(offset) + correction.reshape(f.shape)
