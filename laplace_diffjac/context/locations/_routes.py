"""Two ways to get the objective's Grams: per-layer features or Jacobians.

A route turns inputs into *pieces* (one side's share of the kernel) and contracts
two sides' pieces into a Gram. The training side's pieces do not depend on the
locations, so the optimiser computes them once and reuses them at every step:

* :class:`StructuredRoute` (chains of Linear layers and elementwise activations,
  scalar prior): the pieces are :class:`laplace_diffjac.kernels.NTKFeatures`,
  ``B (width_in + C width_out)`` numbers per layer, never ``J``;
* :class:`JacobianRoute` (any backend, any prior): the pieces are the Jacobians
  ``(B, C, P)``.

Pieces and Grams are float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Union

import torch

from ...backends import JacobianBackend
from ...kernels import PriorPrecision, jacobians, n_jacobian_columns
from ...kernels._cross_gram import cross_feature_gram
from ...kernels._ntk import flat_gram, prior_variance, structured_applies
from ...kernels._structured import structured_features
from ...kernels._structured_features import NTKFeatures, feature_diag
from ...kernels._symmetric_gram import symmetric_feature_gram

Pieces = Union[NTKFeatures, torch.Tensor]
_F64 = torch.float64

__all__ = ["JacobianRoute", "Pieces", "Route", "StructuredRoute", "make_route"]


@dataclass(frozen=True)
class StructuredRoute:
    """Grams from per-layer features (as in :func:`~laplace_diffjac.structured_ntk`)."""

    backend: JacobianBackend
    prior_var: torch.Tensor

    def pieces(self, x: torch.Tensor, graph: bool) -> NTKFeatures:
        """Features of ``x`` ``(B, *input_shape)``; with graph if ``graph``."""
        with nullcontext() if graph else torch.no_grad():
            f = structured_features(self.backend.model, x).to(_F64)
        return f if graph else f.detach()

    def cross(self, a: Pieces, b: Pieces) -> torch.Tensor:
        """``(B1 C, B2 C)`` prior-scaled Gram, input-major (``b`` usually detached)."""
        return cross_feature_gram(_features(a), _features(b), self.prior_var)

    def self_gram(self, a: Pieces) -> torch.Tensor:
        """``(B C, B C)`` Gram of a batch with itself, for a symmetric consumer."""
        return symmetric_feature_gram(_features(a), self.prior_var)

    def diag(self, a: Pieces) -> torch.Tensor:
        """``(B, C, C)`` per-input blocks."""
        return feature_diag(_features(a), self.prior_var)

    @staticmethod
    def cat(parts: Sequence[Pieces]) -> NTKFeatures:
        """Concatenate pieces of consecutive batches."""
        return NTKFeatures.cat([_features(p) for p in parts])


@dataclass(frozen=True)
class JacobianRoute:
    """Grams from the backend's Jacobians (:func:`laplace_diffjac.kernels.gram`)."""

    backend: JacobianBackend
    prior_var: torch.Tensor

    def pieces(self, x: torch.Tensor, graph: bool) -> torch.Tensor:
        """Jacobians ``(B, C, P)`` of ``x``; graph-connected if ``graph``."""
        if graph:
            return jacobians(self.backend, x).to(_F64)
        with torch.no_grad():
            return jacobians(self.backend, x, enable_backprop=False).to(_F64)

    def cross(self, a: Pieces, b: Pieces) -> torch.Tensor:
        """``(B1 C, B2 C)`` prior-scaled Gram, input-major."""
        return flat_gram(_jacobians(a), _jacobians(b), self.prior_var)

    def self_gram(self, a: Pieces) -> torch.Tensor:
        """``(B C, B C)`` Gram of a batch with itself."""
        return flat_gram(_jacobians(a), _jacobians(a), self.prior_var)

    def diag(self, a: Pieces) -> torch.Tensor:
        """``(B, C, C)`` per-input blocks."""
        J = _jacobians(a)
        return torch.einsum("bcp,bep->bce", J * self.prior_var, J)

    @staticmethod
    def cat(parts: Sequence[Pieces]) -> torch.Tensor:
        """Concatenate pieces of consecutive batches."""
        return torch.cat([_jacobians(p) for p in parts])


Route = Union[StructuredRoute, JacobianRoute]


def _features(p: Pieces) -> NTKFeatures:
    if not isinstance(p, NTKFeatures):
        raise TypeError("The structured route takes NTKFeatures pieces.")
    return p


def _jacobians(p: Pieces) -> torch.Tensor:
    if not isinstance(p, torch.Tensor):
        raise TypeError("The Jacobian route takes Jacobian pieces (B, C, P).")
    return p


def make_route(
    backend: JacobianBackend,
    prior_precision: PriorPrecision,
    structured: bool | None,
    device: torch.device,
) -> Route:
    """Pick the route for a backend and prior.

    Parameters
    ----------
    backend : JacobianBackend
        The Jacobian backend (its model and parameters decide the structured route).
    prior_precision : float or torch.Tensor
        Scalar or per-parameter ``(P,)``.
    structured : bool, optional
        ``None``: structured where it applies, else Jacobians; ``True``: require
        it; ``False``: always Jacobians.
    device : torch.device
        Device of the model.

    Returns
    -------
    StructuredRoute or JacobianRoute

    Raises
    ------
    ValueError
        If ``structured=True`` but the route does not apply, or the prior
        precision has the wrong size or is not positive.

    """
    like = torch.empty((), dtype=_F64, device=device)
    prior_var = prior_variance(prior_precision, n_jacobian_columns(backend), like)
    if structured is not False and structured_applies(backend, prior_var):
        return StructuredRoute(backend, prior_var)
    if structured:
        raise ValueError(
            "structured=True, but the structured route does not apply (the model "
            "is not a chain of Linear layers and elementwise activations, the "
            "prior is per-parameter, or the backend is last-layer/subnetwork); "
            "pass structured=None or False."
        )
    return JacobianRoute(backend, prior_var)
