"""Linearised-Laplace posterior seeing all ``N`` points through ``M`` locations.

DTC / Nyström form with the GGN likelihood Hessian. With the prior-scaled NTK
``K = J Σ₀ Jᵀ``, locations ``Z`` and the GGN likelihood Hessians
``Λ = blockdiag(Λₙ)`` of all training points, the latent posterior covariance at
test inputs is::

    Σ** = K** − K*Z (K_ZZ⁻¹ − (K_ZZ + K_ZX Λ K_XZ)⁻¹) K_Z*

and the mean is the MAP network's output. ``fit`` accumulates ``K_ZX Λ K_XZ`` (per
prior group, without ``1 / (σ² T)``; ``_state``) batch by batch, all-reduced over a
``torch.distributed`` group (``_reduce``). With ``Z = X`` and an invertible ``K_XX``
this is the full-data GGN Laplace and ``log_marginal_likelihood`` its evidence,
else a lower bound (derivation in ``_evidence``). In float64, ``K_ZZ = L Lᵀ``,
``L⁻¹ (K_ZX Λ K_XZ) L⁻ᵀ = U diag(s) Uᵀ``, ``W = L⁻ᵀ U diag(√(s / (1 + s)))`` and
``Σ** = K** − (K*Z W)(K*Z W)ᵀ``: no inverse of ``Λ`` (singular for softmax). The
factor is rebuilt whenever a hyperparameter changed: never a stale answer.
"""

from __future__ import annotations

import torch
from torch import nn

from ..backends import BackendSpec, DiffBackPackGGN, as_backend
from ..errors import InvalidInputError
from ..kernels import PriorPrecision, flat_gram, jacobians
from ._data import Data
from ._data_pass import accumulate, check_data, model_jacobians
from ._distributed import is_distributed
from ._factor_cache import FactorCache
from ._hyperparameters import PriorGroups, infer_structure
from ._laplace_api import LaplaceInterface, layer_sizes
from ._predictive import gaussian_samples, link_probabilities
from ._reduce import reduce_accumulators
from ._state import Accumulators
from ._training_data import check_inputs

__all__ = ["ContextPosterior"]


class ContextPosterior(LaplaceInterface):
    """DTC linearised-Laplace posterior through context locations.

    Call it like a laplace-torch Laplace object: ``la(x)`` returns ``(mean, var)``
    for regression (latent variance without observation noise, as laplace-torch)
    and class probabilities for classification. ``log_marginal_likelihood``,
    ``optimize_prior_precision``, ``state_dict`` and ``load_state_dict`` work as
    laplace-torch's.

    Parameters
    ----------
    model : torch.nn.Module
        Trained network (MAP); not changed.
    likelihood : {'regression', 'classification'}
        The likelihood.
    locations : torch.Tensor
        Context locations ``Z``, ``(M, *input_shape)``, finite, in the model's dtype.
    sigma_noise : float or torch.Tensor, default=1.0
        Observation noise (regression); may be changed after ``fit``.
    prior_precision : float or torch.Tensor, default=1.0
        Scalar, layerwise ``(n_layers,)`` or per-parameter ``(P,)``.
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
    prior_mean : float or torch.Tensor, default=0.0
        Prior mean ``μ₀`` (scalar or ``(P,)``); enters the evidence only.
    prior_structure : {'scalar', 'layerwise', 'diag'}, optional
        Which prior precisions may be set after ``fit`` without a new pass over
        the data (default: that of ``prior_precision``); see
        :mod:`~laplace_diffjac.context._hyperparameters`. ``'layerwise'`` keeps
        ``n_layers²`` blocks of ``(MC)²``.

    Raises
    ------
    ValueError
        For an unknown likelihood, ``sigma_noise != 1`` with classification or an
        invalid prior precision or structure.
    InvalidInputError
        For locations that are not finite, not in the model's dtype or not batched.

    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        locations: torch.Tensor,
        sigma_noise: float | torch.Tensor = 1.0,
        prior_precision: PriorPrecision = 1.0,
        temperature: float = 1.0,
        backend: BackendSpec = DiffBackPackGGN,
        enable_backprop: bool = False,
        jitter: float = 1e-8,
        batch_size: int = 256,
        prior_mean: float | torch.Tensor = 0.0,
        prior_structure: str | None = None,
    ) -> None:
        if likelihood not in ("regression", "classification"):
            raise ValueError(
                "likelihood must be 'regression' or 'classification', got "
                f"{likelihood!r}."
            )
        param = next(iter(model.parameters()))
        check_inputs(locations, "locations", param.dtype, None)
        self.model = model
        self.likelihood = likelihood
        self.locations = locations.detach()
        self.backend = as_backend(model, likelihood, backend)
        self._dtype, self._device = param.dtype, param.device
        self._layer_sizes = layer_sizes(self.backend)
        self.prior_precision = prior_precision
        self.sigma_noise = sigma_noise
        self.temperature = temperature
        self.prior_mean = prior_mean
        infer_structure(prior_structure, self.prior_precision, self.n_layers)
        self._structure_request = prior_structure
        self.enable_backprop = enable_backprop
        self.jitter = jitter
        self.batch_size = batch_size
        self._acc: Accumulators | None = None
        self._groups: PriorGroups | None = None
        self._factors = FactorCache()

    def fit(self, train_loader: Data, progress_bar: bool = False) -> ContextPosterior:
        """Accumulate the data's sums (``K_ZX Λ K_XZ``, GGN diagonal, loss).

        Parameters
        ----------
        train_loader : DataLoader, torch.Tensor or tuple
            Training data: a loader of ``(x, y)`` batches (also over an
            ``IterableDataset``; one batch is held at a time), inputs or
            ``(x, y)``. The posterior needs no targets; the evidence does.
            Under ``torch.distributed``: this rank's shard (may be empty); the
            sums are all-reduced, so every rank gets the same posterior. Every
            rank must call ``fit``.
        progress_bar : bool, default=False
            Show a tqdm progress bar.

        Returns
        -------
        ContextPosterior
            ``self``.

        Raises
        ------
        InvalidInputError
            For training inputs that are not finite, have another feature shape
            than the locations or another dtype than the model (before any work
            for tensors; for a loader the posterior is left as it was), for a
            ``DistributedSampler`` that pads its shards with repeated points, or
            if there are no training points at all.

        """
        check_data(train_loader, "train_loader", self._dtype, self.locations.shape[1:])
        prec = self.prior_precision.detach()
        structure = infer_structure(self._structure_request, prec, self.n_layers)
        groups = PriorGroups.build(structure, prec, self._layer_sizes)
        Z = self.locations.to(self._device)
        J_z = jacobians(self.backend, Z, enable_backprop=False).to(torch.float64)
        acc = Accumulators.empty(J_z.detach(), groups)
        accumulate(self, acc, groups, train_loader, progress_bar)
        reduce_accumulators(acc)
        if acc.n_data == 0:
            raise InvalidInputError(
                "train_loader yielded no training points (on any rank); pass the "
                "training data."
            )
        self._acc, self._groups = acc, groups
        self._factors.clear()
        return self

    def update(
        self, x_new: torch.Tensor, y_new: torch.Tensor | None = None
    ) -> ContextPosterior:
        """Fold new data into the posterior without touching the old data.

        Costs ``O(b (MC)²)`` per group pair plus the new Jacobians; the result
        equals ``fit`` on the union of the data (the sums are additive).

        Parameters
        ----------
        x_new : torch.Tensor
            ``(b, *input_shape)``; under ``torch.distributed`` this rank's new
            points (``b = 0`` allowed), reduced over the ranks like ``fit``'s;
            every rank must call ``update``.
        y_new : torch.Tensor, optional
            ``(b, ...)`` targets; without them the evidence is unavailable.

        Returns
        -------
        ContextPosterior
            ``self``.

        Raises
        ------
        RuntimeError
            Before ``fit``.
        InvalidInputError
            As for :meth:`fit`.

        """
        acc, groups = self._fitted()
        shape = self.locations.shape[1:]
        check_inputs(x_new, "x_new", self._dtype, shape, allow_empty=is_distributed())
        data = x_new if y_new is None else (x_new, y_new)
        new = acc.zeros_like()
        accumulate(self, new, groups, data, progress_bar=False)
        reduce_accumulators(new)  # only the new sums: the old ones are reduced
        acc.merge(new)
        self._factors.clear()
        return self

    def _factor(self) -> torch.Tensor:
        acc, _ = self._fitted()
        s, _, h = self._scales()
        return self._factors.prediction_factor(acc, s, h, self.jitter)

    def _kernel_prior_var(self) -> torch.Tensor:
        """``Σ₀`` for test kernels: ``()`` if scalar-structured, else ``(P,)``."""
        _, groups = self._fitted()
        s, prior_var, _ = self._scales()
        if groups.structure == "scalar":
            return s.detach()[0]
        return prior_var.detach()

    def _k_star_z(self, Js: torch.Tensor) -> torch.Tensor:
        """``K*Z`` as ``(B*, C, M*C)`` in float64."""
        acc, _ = self._fitted()
        K = flat_gram(Js.to(torch.float64), acc.J_z, self._kernel_prior_var())
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
        var = self._kernel_prior_var()
        K_ss = torch.einsum("bcp,bep->bce", Js64 * var, Js64)
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
        K_ss = (J * self._kernel_prior_var()) @ J.T
        V = self._k_star_z(Js).reshape(J.shape[0], -1) @ W
        return (K_ss - V @ V.T).to(Js.dtype)

    def _glm_predictive_distribution(
        self, x: torch.Tensor, joint: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        Js, f = model_jacobians(self.backend, x, self.enable_backprop)
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
        fitting: bool = False,
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
        fitting : bool, default=False
            Accepted for laplace-torch's ``validate``; no effect.

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
            raise ValueError(f"pred_type must be 'glm' or 'gp', got {pred_type!r}.")
        regression = self.likelihood == "regression"
        f_mu, f_var = self._glm_predictive_distribution(x, joint=joint and regression)
        if regression:
            if diagonal_output and not joint:
                f_var = f_var.diagonal(dim1=-2, dim2=-1)
            return f_mu, f_var
        return link_probabilities(
            f_mu, f_var, link_approx, n_samples, diagonal_output, generator
        )

    def predictive_samples(
        self,
        x: torch.Tensor,
        pred_type: str = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Samples of the predictive (softmax applied for classification).

        Parameters
        ----------
        x : torch.Tensor
            ``(B*, *input_shape)``.
        pred_type : {'glm', 'gp'}, default='glm'
            As laplace-torch's; both mean the linearised predictive.
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

        Raises
        ------
        ValueError
            For an unsupported ``pred_type``.

        """
        if pred_type not in ("glm", "gp"):
            raise ValueError(f"pred_type must be 'glm' or 'gp', got {pred_type!r}.")
        f_mu, f_var = self._glm_predictive_distribution(x)
        samples = gaussian_samples(f_mu, f_var, n_samples, diagonal_output, generator)
        return samples if self.likelihood == "regression" else samples.softmax(-1)
