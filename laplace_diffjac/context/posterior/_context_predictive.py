"""The context posterior's latent predictive: from test inputs to mean and covariance.

Given a fit's sums (:class:`._statistics.Accumulators`) and prior groups, a
batch of test inputs becomes features (the Linear layers' inputs and signals,
factors or ``J``, :mod:`._linear_predictions`, :mod:`._features`), their
whitened cross term with the locations ``T = L₀⁻¹ K_Z*`` and their prior Grams;
the mean is the network's (or the dual mean) and the covariance
``K** − V Vᵀ + W Wᵀ`` (:func:`._predictive.latent_covariance`), per input or
joint over q-batches, within the memory budget. :class:`ContextPredictive` is
that half of :class:`~._posterior.ContextPosterior`; the other half (fit,
update, hyperparameters, evidence, state) provides the hooks it declares.
"""

from __future__ import annotations

import torch

from ...backends import JacobianBackend
from ...budget import get_memory_budget
from ...data import check_inputs
from ...kernels._feature_sizes import FeatureSizes
from ._chunks import test_slices
from ._dual_mean import dual_mean
from ._factor_cache import FactorCache, PredictiveFactor
from ._features import BatchFeatures, batch_features, given_jacobians
from ._hyperparameters import PriorGroups
from ._laplace_predictive import LaplacePredictive
from ._linear_predictions import (
    LinearLayerBatch,
    LinearPredictions,
    PredictiveFeatures,
    linear_layer_batch,
)
from ._predictive import latent_covariance, q_batch_shape
from ._statistics import Accumulators

__all__ = ["ContextPredictive"]


class ContextPredictive(LaplacePredictive):
    """The latent predictive of a fitted context posterior.

    Public: ``joint_predictive``, ``functional_variance``,
    ``functional_covariance``, and laplace-torch's ``la(x)`` and
    ``predictive_samples`` (:class:`._laplace_predictive.LaplacePredictive`).

    Attributes
    ----------
    locations : torch.Tensor
        ``(M, *input_shape)``.
    predictive_mean : str
        ``'network'`` or ``'dual'``.
    enable_backprop, structured : bool
        As :class:`~._posterior.ContextPosterior`'s.
    jitter : float
        The fit's jitter.

    """

    locations: torch.Tensor
    predictive_mean: str
    enable_backprop: bool
    structured: bool
    jitter: float
    _compute_backend: JacobianBackend
    _dtype: torch.dtype
    _compute_dtype: torch.dtype
    _device: torch.device
    _sizes: FeatureSizes | None
    _factors: FactorCache
    _linear: LinearPredictions | None

    # -- hooks the posterior provides ----------------------------------------

    def _fitted(self) -> tuple[Accumulators, PriorGroups]:
        raise NotImplementedError

    def _scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _offset(self) -> torch.Tensor:
        raise NotImplementedError

    def _data_chunk(self, batch: int) -> int:
        raise NotImplementedError

    # -- the predictive --------------------------------------------------------

    def _dual_mean(
        self, features: BatchFeatures, T: torch.Tensor | None = None
    ) -> torch.Tensor:
        acc, _ = self._fitted()
        s, h = self._group_scales()
        T = self._whitened_cross(features) if T is None else T
        return dual_mean(acc, self._factor(), T, features, self._offset(), s, h)

    def _factor(self) -> PredictiveFactor:
        acc, _ = self._fitted()
        s, h = self._group_scales()
        return self._factors.prediction_factor(acc, s, h, self.jitter)

    def _kernel_prior_var(self) -> torch.Tensor:
        """``Σ₀`` for test kernels: ``()`` if scalar-structured, else ``(P,)``."""
        _, groups = self._fitted()
        if groups.structure == "scalar":
            return self._group_scales()[0].detach()[0]
        return self._scales()[1].detach()

    def _whitened_cross(
        self, features: BatchFeatures | LinearLayerBatch
    ) -> torch.Tensor:
        """``L₀⁻¹ K_Z*`` ``(MC, B* C)`` in float64 at the current prior."""
        acc, _ = self._fitted()
        s, _ = self._group_scales()
        if isinstance(features, LinearLayerBatch):
            assert self._linear is not None  # what made these features
            return self._linear.whitened_cross(acc.L0, features, s.detach()[0])
        return acc.whitened(features, scales=s.detach())[0]

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
        features = given_jacobians(Js)
        T = self._whitened_cross(features)
        return self._variance(features, T).to(Js.dtype)

    def _variance(self, features: PredictiveFeatures, T: torch.Tensor) -> torch.Tensor:
        """Per-input covariances ``(B*, C, C)`` given ``T = L₀⁻¹ K_Z*`` (float64)."""
        V, W = self._factor().project(T)
        K_ss = features.self_blocks(self._kernel_prior_var())
        return latent_covariance(K_ss, V, W)

    def functional_covariance(self, Js: torch.Tensor) -> torch.Tensor:
        """Joint latent posterior covariance of all test outputs (per batch).

        Parameters
        ----------
        Js : torch.Tensor
            Jacobians at the test inputs, ``(*batch, B*, C, P)``.

        Returns
        -------
        torch.Tensor
            ``(*batch, B* C, B* C)``, ordered input-major as laplace-torch: the
            joint covariance of each batch's ``B*`` inputs, none across batches.

        """
        lead, (q, C, P) = Js.shape[:-3], Js.shape[-3:]
        features = given_jacobians(Js.reshape(-1, C, P))
        covariance = self._covariance(features, self._whitened_cross(features), q)
        return covariance.reshape(*lead, q * C, q * C).to(Js.dtype)

    def _covariance(
        self, features: PredictiveFeatures, T: torch.Tensor, q: int
    ) -> torch.Tensor:
        """Joint covariances ``(B* / q, q C, q C)`` of consecutive ``q`` inputs."""
        V, W = self._factor().project(T)
        K_ss = features.joint_blocks(self._kernel_prior_var(), q)
        return latent_covariance(K_ss, V, W)

    def joint_predictive(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint latent predictive of batches of inputs (BoTorch's q-batches).

        Parameters
        ----------
        x : torch.Tensor
            ``(*batch, q, *input_shape)``; ``batch`` may be empty.

        Returns
        -------
        mean : torch.Tensor
            ``(*batch, q, C)``, the predictive mean (``predictive_mean``).
        covariance : torch.Tensor
            ``(*batch, q C, q C)`` input-major, without observation noise;
            differentiable in ``x`` with ``enable_backprop=True``.

        Raises
        ------
        InvalidInputError
            For inputs without a ``q`` axis in front of the locations' feature
            shape, or as for prediction.

        """
        lead = q_batch_shape(x, self.locations.shape[1:])
        flat = x.reshape(-1, *self.locations.shape[1:])
        q = lead[-1]
        means, covariances = [], []
        for where in self._test_chunks(flat, q):
            f, features, T = self._predictive_pieces(flat[where])
            means.append(f)
            covariances.append(self._covariance(features, T, q))
            del features, T
        f, C = torch.cat(means), means[0].shape[-1]
        covariance = torch.cat(covariances).reshape(*lead[:-1], q * C, q * C)
        return self._as_output(f.reshape(*lead, -1), covariance)

    def _predictive_pieces(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, PredictiveFeatures, torch.Tensor]:
        # The mean (B*, C), the features (Linear layers', factors or Jacobians)
        # and T = L₀⁻¹ K_Z* (MC, B* C), computed once for the mean and the
        # covariance.
        check_inputs(x, "x", self._dtype, self.locations.shape[1:])
        x = x.to(self._compute_dtype)
        if self._linear is not None and self.predictive_mean != "dual":
            linear = linear_layer_batch(self._compute_backend, x, self.enable_backprop)
            if linear is not None:
                return linear.f, linear, self._whitened_cross(linear)
        features = batch_features(
            self._compute_backend, x, self.enable_backprop, self.structured
        )
        T = self._whitened_cross(features)
        f = features.f
        if self.predictive_mean == "dual":
            f = self._dual_mean(features, T)
        return f, features, T

    def _as_output(
        self, mean: torch.Tensor, var: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mean, var = mean.to(self._dtype), var.to(self._dtype)
        if not self.enable_backprop:
            return mean.detach(), var.detach()
        return mean, var

    def _glm_predictive_distribution(
        self, x: torch.Tensor, joint: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if joint:
            f, features, T = self._predictive_pieces(x)
            covariance = self._covariance(features, T, features.batch)[0]
            return self._as_output(f.flatten(), covariance)
        means, variances = [], []
        for where in self._test_chunks(x, 1):
            f, features, T = self._predictive_pieces(x[where])
            means.append(f)
            variances.append(self._variance(features, T))
            del features, T
        return self._as_output(torch.cat(means), torch.cat(variances))

    def _test_chunks(self, x: torch.Tensor, q: int) -> list[slice]:
        """Slices of ``x`` (whole ``q``-blocks) that fit (:func:`test_slices`)."""
        grad = self.enable_backprop and torch.is_grad_enabled()
        chunk = self._data_chunk(len(x))
        budget = get_memory_budget(self._device)
        return test_slices(len(x), q, chunk, grad, self._sizes, budget)
