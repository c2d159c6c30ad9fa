"""Predictions' Grams from the Linear layers' inputs and signals.

Everything a prediction computes from the test inputs' Jacobians is a Gram
under the prior: against the locations (``K_Z*``), and of the test inputs with
themselves (per input, or joint over q-batches). Where every parameter is a
plain ``nn.Linear``'s, called once on one feature vector per input (an MLP,
whatever its module structure), and the prior variance is one scalar,

    J(x1) J(x2)ᵀ = Σ_l (a_l(x1)·a_l(x2) + 1[bias]) g_l(x1) g_l(x2)ᵀ

from the layers' inputs ``a_l`` and output signals ``g_l``
(:mod:`laplace_diffjac.kernels._structured_features`), straight off the engine's
pass: no ``J`` and no factor objects, and a backward pass through a few small
products per layer instead of through ``J``'s assembly. At Bayesian-optimisation
sizes that is 0.75–0.93× the time of a BoTorch posterior call with its gradient
(``benchmarks/bayesopt/POSTERIOR_CALLS.md``). :class:`LinearPredictions` holds
the locations' side for one fit.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ...backends import JacobianBackend
from ...jacobians._linear_layers import LinearSignals
from ...kernels import factor_route_applies
from ...kernels._engine_pieces import linear_pieces
from ...kernels._structured_features import (
    NTKFeatures,
    feature_diag,
    feature_gram,
    linear_features,
)
from ._features import BatchOutputs, grouped_joint_blocks

__all__ = [
    "LinearLayerBatch",
    "LinearPredictions",
    "PredictiveFeatures",
    "linear_layer_batch",
    "only_linear_parameters",
]


class PredictiveFeatures(Protocol):
    """What a prediction's covariance needs of a batch's features."""

    f: torch.Tensor

    @property
    def batch(self) -> int: ...

    def self_blocks(self, prior_var: torch.Tensor) -> torch.Tensor: ...

    def joint_blocks(self, prior_var: torch.Tensor, q: int) -> torch.Tensor: ...


class LinearLayerBatch(BatchOutputs):
    """A batch's Linear layers' inputs and signals, for Grams under a scalar prior.

    The products a prediction needs (:class:`PredictiveFeatures`, and the cross
    Gram with the locations) without ``J`` or factor objects:
    ``J(x1) J(x2)ᵀ = Σ_l (a_l(x1)·a_l(x2) + 1[bias]) g_l(x1) g_l(x2)ᵀ``
    (:func:`~laplace_diffjac.kernels._structured_features.feature_gram`).

    Parameters
    ----------
    features : NTKFeatures
        The layers' inputs and signals (cast to float64).
    f : torch.Tensor
        ``(b, C)`` or ``(b,)`` the network's outputs (cast to float64).

    """

    def __init__(self, features: NTKFeatures, f: torch.Tensor) -> None:
        self.features = features.to(torch.float64)
        self.f = f.to(torch.float64).reshape(len(features), features.n_outputs)

    def gram(self, other: LinearLayerBatch, prior_var: torch.Tensor) -> torch.Tensor:
        """``σ₀² J J_otherᵀ`` ``(b C, b_other C)``, rows ``(input, output)``-major.

        Parameters
        ----------
        other : LinearLayerBatch
            Of the same model and parameters.
        prior_var : torch.Tensor
            ``()``, the scalar prior variance.

        Returns
        -------
        torch.Tensor

        """
        return feature_gram(self.features, other.features, _scalar(prior_var))

    def self_blocks(self, prior_var: torch.Tensor) -> torch.Tensor:
        """``σ₀² J_b J_bᵀ`` per input, ``(b, C, C)``."""
        return feature_diag(self.features, _scalar(prior_var))

    def joint_blocks(self, prior_var: torch.Tensor, q: int) -> torch.Tensor:
        """Joint Grams of consecutive groups of ``q`` inputs, ``(b / q, q C, q C)``.

        As the factors' (:func:`._features.grouped_joint_blocks`).

        Returns
        -------
        torch.Tensor

        """
        var = _scalar(prior_var)
        if q == 1:
            return self.self_blocks(var)

        def gram(start: int, stop: int) -> torch.Tensor:
            part = self.features[start:stop]
            return feature_gram(part, part, var)

        return grouped_joint_blocks(self.batch, q, self.n_outputs, gram, self.f)

    def detach(self) -> LinearLayerBatch:
        """The same features, cut from the graph."""
        return LinearLayerBatch(self.features.detach(), self.f.detach())


def _scalar(prior_var: torch.Tensor) -> torch.Tensor:
    """``prior_var`` as the ``()`` tensor :class:`LinearLayerBatch` needs."""
    if prior_var.dim() != 0:
        raise ValueError(
            "Linear layers' features take one scalar prior variance, got shape "
            f"{tuple(prior_var.shape)}."
        )
    return prior_var.to(torch.float64)


def only_linear_parameters(backend: JacobianBackend) -> bool:
    """Whether every parameter of ``backend`` belongs to a plain ``nn.Linear``.

    The structural half of :func:`linear_layer_batch`'s condition, without a
    pass (the other half, one call per layer on ``(B, in)`` inputs, shows in
    the pass).

    Returns
    -------
    bool

    """
    if not factor_route_applies(backend):
        return False
    owned = {
        id(p)
        for module in backend.model.modules()
        if type(module) is nn.Linear
        for p in module.parameters(recurse=False)
    }
    return all(id(p) in owned for p in backend.params)


def linear_layer_batch(
    backend: JacobianBackend, x: Any, enable_backprop: bool
) -> LinearLayerBatch | None:
    """The Linear layers' features of ``x``, or ``None`` where they do not apply.

    Parameters
    ----------
    backend : JacobianBackend
        One :func:`only_linear_parameters` holds for.
    x : torch.Tensor
        ``(b, *input_shape)`` in the backend model's dtype and device.
    enable_backprop : bool
        Keep the graph to ``x`` (and the parameters).

    Returns
    -------
    LinearLayerBatch or None
        ``None`` where a Linear layer runs on tokens or twice (the engine then
        gives factors).

    """
    pieces = linear_pieces(backend, x, enable_backprop)
    if not isinstance(pieces, LinearSignals):
        return None
    return LinearLayerBatch(linear_features(pieces), pieces.f)


class LinearPredictions:
    """The locations' Linear layers' features for one fit, and the test side's.

    Parameters
    ----------
    locations : LinearLayerBatch
        The locations' features, detached, from the model the fit used.

    """

    def __init__(self, locations: LinearLayerBatch) -> None:
        self.locations = locations

    @staticmethod
    def of(
        backend: JacobianBackend, locations: torch.Tensor, scalar_prior: bool
    ) -> LinearPredictions | None:
        """The route for a fit, where it applies; ``None`` elsewhere.

        Parameters
        ----------
        backend : JacobianBackend
            The posterior's compute backend, as the fit used it.
        locations : torch.Tensor
            ``(M, *input_shape)`` in the backend model's dtype.
        scalar_prior : bool
            Whether the fit's prior is one scalar (and the locations held whole).

        Returns
        -------
        LinearPredictions or None

        """
        if not scalar_prior or not only_linear_parameters(backend):
            return None
        with torch.no_grad():
            batch = linear_layer_batch(backend, locations, False)
        return None if batch is None else LinearPredictions(batch.detach())

    def whitened_cross(
        self, L0: torch.Tensor, batch: LinearLayerBatch, prior_var: torch.Tensor
    ) -> torch.Tensor:
        """``L₀⁻¹ K_Z*`` ``(MC, b C)`` at the scalar prior variance ``prior_var``.

        Returns
        -------
        torch.Tensor

        """
        K = self.locations.gram(batch, prior_var)
        return torch.linalg.solve_triangular(L0, K, upper=False)
