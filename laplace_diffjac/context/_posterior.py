"""Linearised-Laplace posterior seeing all ``N`` points through ``M`` locations.

DTC / Nyström form with the GGN likelihood Hessian.

With the prior-scaled NTK ``K = J Σ₀ Jᵀ``, locations ``Z`` and the GGN likelihood
Hessians ``Λ = blockdiag(Λₙ)`` of all training points, the latent posterior
covariance at test inputs is::

    Σ** = K** − K*Z (K_ZZ⁻¹ − (K_ZZ + K_ZX Λ K_XZ)⁻¹) K_Z*

and the mean is the MAP network's output (the linearised predictive). ``K_ZX Λ K_XZ``
is accumulated over minibatches, so memory is linear in ``N`` only through the data
loader and, beyond one minibatch's Jacobians, depends on ``P`` only through the
stored ``J(Z)`` (``M × C × P``). With ``Z = X`` (``M = N``) and an invertible
``K_XX`` this is exactly the full-data GGN Laplace predictive.

The factor is computed in float64 as ``K_ZZ = L Lᵀ``,
``L⁻¹ (K_ZX Λ K_XZ) L⁻ᵀ = U diag(s) Uᵀ`` and ``W = L⁻ᵀ U diag(√(s / (1 + s)))``, so
``Σ** = K** − (K*Z W)(K*Z W)ᵀ`` needs no inverse of ``Λ`` (singular for softmax).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm import tqdm

from ..backends import BackendSpec, DiffBackPackGGN, as_backend
from ..kernels import (
    PriorPrecision,
    flat_gram,
    jacobians,
    jittered_cholesky,
    output_hessians,
    prior_variance,
)
from ._data import Data, input_batches

__all__ = ["ContextPosterior"]

_LINKS = ("probit", "mc", "bridge", "bridge_norm")


class ContextPosterior:
    """DTC linearised-Laplace posterior through context locations.

    Call it like a laplace-torch Laplace object: ``la(x)`` returns ``(mean, var)``
    for regression (latent variance without observation noise, as laplace-torch)
    and class probabilities for classification.

    Parameters
    ----------
    model : torch.nn.Module
        Trained network (MAP); not changed.
    likelihood : {'regression', 'classification'}
        The likelihood.
    locations : torch.Tensor
        Context locations ``Z``, ``(M, *input_shape)``.
    sigma_noise : float, default=1.0
        Observation noise (regression); may be changed after ``fit``.
    prior_precision : float or torch.Tensor, default=1.0
        Scalar or per-parameter ``(P,)`` prior precision, fixed at ``fit``.
    temperature : float, default=1.0
        Likelihood temperature; may be changed after ``fit``.
    backend : type or backend instance, default=DiffBackPackGGN
        Jacobian backend.
    enable_backprop : bool, default=False
        Keep predictions differentiable with respect to the test inputs.
    jitter : float, default=1e-8
        Diagonal jitter of ``K_ZZ`` relative to its mean diagonal entry.
    batch_size : int, default=256
        Minibatch size when ``fit`` gets tensors.

    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        locations: torch.Tensor,
        sigma_noise: float = 1.0,
        prior_precision: PriorPrecision = 1.0,
        temperature: float = 1.0,
        backend: BackendSpec = DiffBackPackGGN,
        enable_backprop: bool = False,
        jitter: float = 1e-8,
        batch_size: int = 256,
    ) -> None:
        if likelihood not in ("regression", "classification"):
            raise ValueError(f"Unsupported likelihood {likelihood!r}.")
        if likelihood == "classification" and sigma_noise != 1:
            raise ValueError("sigma_noise != 1 only available for regression.")
        self.model = model
        self.likelihood = likelihood
        self.locations = locations.detach()
        self.sigma_noise = sigma_noise
        self.prior_precision = prior_precision
        self.temperature = temperature
        self.backend = as_backend(model, likelihood, backend)
        self.enable_backprop = enable_backprop
        self.jitter = jitter
        self.batch_size = batch_size
        self.n_data = 0
        self._J_z: torch.Tensor | None = None
        self._prior_var: torch.Tensor | None = None
        self._B: torch.Tensor | None = None  # K_ZX Λ̃ K_XZ, Λ̃ without the factor
        self._W: torch.Tensor | None = None
        self._W_key: tuple | None = None

    @property
    def _H_factor(self) -> float:
        sigma2 = float(self.sigma_noise) ** 2 if self.likelihood == "regression" else 1
        return 1.0 / (sigma2 * self.temperature)

    def fit(self, train_loader: Data, progress_bar: bool = False) -> ContextPosterior:
        """Accumulate ``K_ZX Λ K_XZ`` over the training data.

        Parameters
        ----------
        train_loader : DataLoader, torch.Tensor or tuple
            Training data: a loader of ``(x, y)`` batches, inputs or ``(x, y)``.
            Targets are not used (``Λ`` depends on the MAP output only).
        progress_bar : bool, default=False
            Show a tqdm progress bar.

        Returns
        -------
        ContextPosterior
            ``self``.

        """
        f64 = torch.float64
        device = next(iter(self.model.parameters())).device
        Z = self.locations.to(device)
        J_z = jacobians(self.backend, Z, enable_backprop=False).to(f64)
        self._prior_var = prior_variance(self.prior_precision, J_z.shape[-1], J_z)
        self._J_z = J_z
        M, C, _ = J_z.shape
        B = torch.zeros(M * C, M * C, dtype=f64, device=device)
        n = 0
        batches = input_batches(train_loader, self.batch_size)
        for xb in tqdm(batches, disable=not progress_bar):
            xb = xb.to(device)
            with torch.no_grad():
                Js, f = self.backend.jacobians(xb, enable_backprop=False)
            lam = output_hessians(f.to(f64), self.likelihood)  # without 1/(σ² T)
            K_zx = flat_gram(J_z, Js.to(f64), self._prior_var).reshape(M * C, -1, C)
            B += torch.einsum("kbc,bce,lbe->kl", K_zx, lam, K_zx)
            n += xb.shape[0]
        self._B = 0.5 * (B + B.T)
        self.n_data = n
        self._W = None
        return self

    def _factor(self) -> torch.Tensor:
        if self._B is None or self._J_z is None:
            raise RuntimeError("Call fit before predicting.")
        key = (self._H_factor,)
        if self._W is not None and self._W_key == key:
            return self._W
        J_z = self._J_z
        L = jittered_cholesky(flat_gram(J_z, J_z, self._prior_var), self.jitter)
        B = self._B * self._H_factor
        A = torch.linalg.solve_triangular(L, B, upper=False)
        A = torch.linalg.solve_triangular(L, A.T, upper=False)
        s, U = torch.linalg.eigh(0.5 * (A + A.T))
        s = s.clamp_min(0)
        W = torch.linalg.solve_triangular(L.T, U * torch.sqrt(s / (1 + s)), upper=True)
        self._W, self._W_key = W, key
        return W

    def _k_star_z(self, Js: torch.Tensor) -> torch.Tensor:
        """``K*Z`` as ``(B*, C, M*C)`` in float64."""
        K = flat_gram(Js.to(torch.float64), self._J_z, self._prior_var)
        return K.reshape(Js.shape[0], Js.shape[1], -1)

    def functional_variance(self, Js: torch.Tensor) -> torch.Tensor:
        """Latent posterior covariance per test input.

        Parameters
        ----------
        Js : torch.Tensor
            Jacobians at the test inputs, ``(B*, C, P)``.

        Returns
        -------
        torch.Tensor
            ``(B*, C, C)`` in ``Js``'s dtype.

        """
        W = self._factor()
        Js64 = Js.to(torch.float64)
        K_ss = torch.einsum("bcp,bep->bce", Js64 * self._prior_var, Js64)
        V = self._k_star_z(Js) @ W  # (B*, C, r)
        return (K_ss - V @ V.transpose(1, 2)).to(Js.dtype)

    def functional_covariance(self, Js: torch.Tensor) -> torch.Tensor:
        """Joint latent posterior covariance of all test outputs.

        Parameters
        ----------
        Js : torch.Tensor
            Jacobians at the test inputs, ``(B*, C, P)``.

        Returns
        -------
        torch.Tensor
            ``(B* C, B* C)``, ordered input-major as laplace-torch.

        """
        W = self._factor()
        J = Js.to(torch.float64).reshape(-1, Js.shape[-1])
        K_ss = (J * self._prior_var) @ J.T
        V = self._k_star_z(Js).reshape(J.shape[0], -1) @ W
        return (K_ss - V @ V.T).to(Js.dtype)

    def _glm_predictive_distribution(
        self, x: torch.Tensor, joint: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        Js, f = self.backend.jacobians(x, enable_backprop=self.enable_backprop)
        if joint:
            mean, var = f.flatten(), self.functional_covariance(Js)
        else:
            mean, var = f, self.functional_variance(Js)
        if not self.enable_backprop:
            return mean.detach(), var.detach()
        return mean, var

    def __call__(
        self,
        x: torch.Tensor,
        pred_type: str = "glm",
        joint: bool = False,
        link_approx: str = "probit",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Posterior predictive, as laplace-torch's ``la(x, pred_type='glm')``.

        Parameters
        ----------
        x : torch.Tensor
            Test inputs ``(B*, *input_shape)``.
        pred_type : {'glm', 'gp'}, default='glm'
            Both mean the linearised (GP) predictive.
        joint : bool, default=False
            Regression: return the joint ``(B* C,)`` mean and ``(B* C, B* C)``
            covariance.
        link_approx : {'probit', 'mc', 'bridge', 'bridge_norm'}, default='probit'
            Classification link approximation.
        n_samples : int, default=100
            Samples for ``link_approx='mc'``.
        diagonal_output : bool, default=False
            Regression: return variances ``(B*, C)`` instead of ``(B*, C, C)``;
            ``'mc'``: sample with a diagonal covariance.
        generator : torch.Generator, optional
            Random generator for ``'mc'``.

        Returns
        -------
        torch.Tensor or tuple of torch.Tensor
            Regression: ``(mean (B*, C), var (B*, C, C))`` without observation
            noise (add ``sigma_noise**2`` for the predictive of ``y``).
            Classification: probabilities ``(B*, C)``.

        Raises
        ------
        ValueError
            For an unsupported ``pred_type`` or ``link_approx``.

        """
        if pred_type not in ("glm", "gp"):
            raise ValueError("ContextPosterior supports pred_type='glm' (or 'gp').")
        if link_approx not in _LINKS:
            raise ValueError(f"Unsupported link approximation {link_approx!r}.")
        regression = self.likelihood == "regression"
        f_mu, f_var = self._glm_predictive_distribution(x, joint=joint and regression)
        if regression:
            if diagonal_output and not joint:
                f_var = f_var.diagonal(dim1=-2, dim2=-1)
            return f_mu, f_var
        if link_approx == "mc":
            samples = self._samples(f_mu, f_var, n_samples, diagonal_output, generator)
            return samples.softmax(dim=-1).mean(dim=0)
        if link_approx == "probit":
            kappa = 1 / torch.sqrt(1.0 + math.pi / 8 * f_var.diagonal(dim1=1, dim2=2))
            return torch.softmax(kappa * f_mu, dim=-1)
        return _laplace_bridge(f_mu, f_var, normalise=link_approx == "bridge_norm")

    def predictive_samples(
        self,
        x: torch.Tensor,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Samples of the predictive (softmax applied for classification).

        Parameters
        ----------
        x : torch.Tensor
            ``(B*, *input_shape)``.
        n_samples : int, default=100
            Number of samples.
        diagonal_output : bool, default=False
            Sample with diagonal output covariance.
        generator : torch.Generator, optional
            Random generator.

        Returns
        -------
        torch.Tensor
            ``(n_samples, B*, C)``.

        """
        f_mu, f_var = self._glm_predictive_distribution(x)
        samples = self._samples(f_mu, f_var, n_samples, diagonal_output, generator)
        return samples if self.likelihood == "regression" else samples.softmax(-1)

    @staticmethod
    def _samples(
        f_mu: torch.Tensor,
        f_var: torch.Tensor,
        n_samples: int,
        diagonal_output: bool,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        if diagonal_output:
            f_var = torch.diag_embed(f_var.diagonal(dim1=-2, dim2=-1))
        C = f_mu.shape[-1]
        eye = torch.eye(C, dtype=torch.float64, device=f_mu.device)
        var = f_var.to(torch.float64)
        scale = 1e-10 * var.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
        L = torch.linalg.cholesky(var + scale[:, None, None] * eye).to(f_mu.dtype)
        eps = torch.randn(
            (n_samples, *f_mu.shape),
            generator=generator,
            device=f_mu.device,
            dtype=f_mu.dtype,
        )
        return f_mu + torch.einsum("bce,sbe->sbc", L, eps)


def _laplace_bridge(
    f_mu: torch.Tensor, f_var: torch.Tensor, normalise: bool
) -> torch.Tensor:
    """Laplace bridge, as laplace-torch's ``link_approx='bridge'``/``'bridge_norm'``."""
    f_mu = f_mu - (
        f_var.sum(-1)
        * f_mu.sum(-1).reshape(-1, 1)
        / f_var.sum(dim=(1, 2)).reshape(-1, 1)
    )
    f_var = f_var - torch.einsum(
        "bi,bj->bij", f_var.sum(-1), f_var.sum(-2)
    ) / f_var.sum(dim=(1, 2)).reshape(-1, 1, 1)
    K = f_mu.shape[-1]
    f_var_diag = torch.diagonal(f_var, dim1=1, dim2=2)
    if normalise:
        mean_var = f_var_diag.mean(dim=1) / math.sqrt(K / 2)
        f_mu = f_mu / mean_var.sqrt().unsqueeze(-1)
        f_var_diag = f_var_diag / mean_var.unsqueeze(-1)
    sum_exp = torch.exp(-f_mu).sum(dim=1).unsqueeze(-1)
    alpha = (1 - 2 / K + f_mu.exp() / K**2 * sum_exp) / f_var_diag
    return torch.nan_to_num(alpha / alpha.sum(dim=1).unsqueeze(-1), nan=1.0)
