"""Two ways to get the objective's Grams: per-layer features or Jacobians.

A route turns inputs into *pieces* (one side's share of the kernel) and contracts
two sides' pieces into a Gram. The training side's pieces do not depend on the
locations, so the optimiser computes them once and reuses them at every step:

* :class:`StructuredRoute` (chains of Linear layers and elementwise activations,
  scalar prior): the pieces are :class:`laplace_diffjac.kernels.NTKFeatures`,
  ``B (width_in + C width_out)`` numbers per layer, never ``J``;
* :class:`FactorRoute` (``DiffBackPackGGN``/``DiffBackPackEF`` over all
  parameters, any module structure, any prior): the pieces are the engine's
  per-layer factors (:class:`~laplace_diffjac.jacobians._engine.JacobianFactors`),
  contracted layer by layer (:func:`laplace_diffjac.kernels._factor_gram.factor_gram`),
  never ``J``;
* :class:`JacobianRoute` (any backend, any prior): the pieces are the Jacobians
  ``(B, C, P)``.

Pieces are held in the model's dtype and contracted in float64: a float32
model's pieces take half the memory that float64 copies would, and the Grams are
the numbers the float64 copies give (widening is exact), each contraction
widening its operands for its own duration.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Union

import torch

from ...backends import JacobianBackend
from ...jacobians._engine import JacobianFactors
from ...kernels import PriorPrecision, jacobians, n_jacobian_columns
from ...kernels._cross_gram import cross_feature_gram
from ...kernels._factor_gram import factor_gram
from ...kernels._ntk import (
    factor_route_applies,
    flat_gram,
    prior_variance,
    structured_applies,
)
from ...kernels._structured import structured_features
from ...kernels._structured_features import NTKFeatures, feature_diag
from ...kernels._symmetric_gram import symmetric_feature_gram

Pieces = Union[NTKFeatures, JacobianFactors, torch.Tensor]
_F64 = torch.float64

__all__ = [
    "FactorRoute",
    "JacobianRoute",
    "Pieces",
    "Route",
    "StructuredRoute",
    "make_route",
    "piece_tensors",
    "with_piece_tensors",
]


@dataclass(frozen=True)
class StructuredRoute:
    """Grams from per-layer features (as in :func:`~laplace_diffjac.structured_ntk`)."""

    backend: JacobianBackend
    prior_var: torch.Tensor

    def pieces(self, x: torch.Tensor, graph: bool) -> NTKFeatures:
        """Features of ``x`` ``(B, *input_shape)``; with graph if ``graph``."""
        with nullcontext() if graph else torch.no_grad():
            f = structured_features(self.backend.model, x)
        return f if graph else f.detach()

    def cross(self, a: Pieces, b: Pieces) -> torch.Tensor:
        """``(B1 C, B2 C)`` prior-scaled Gram, input-major (``b`` usually detached)."""
        left, right = _features(a).to(_F64), _features(b).to(_F64)
        return cross_feature_gram(left, right, self.prior_var)

    def self_gram(self, a: Pieces) -> torch.Tensor:
        """``(B C, B C)`` Gram of a batch with itself, for a symmetric consumer."""
        return symmetric_feature_gram(_features(a).to(_F64), self.prior_var)

    def diag(self, a: Pieces) -> torch.Tensor:
        """``(B, C, C)`` per-input blocks."""
        return feature_diag(_features(a).to(_F64), self.prior_var)

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
            return jacobians(self.backend, x)
        with torch.no_grad():
            return jacobians(self.backend, x, enable_backprop=False)

    def cross(self, a: Pieces, b: Pieces) -> torch.Tensor:
        """``(B1 C, B2 C)`` prior-scaled Gram, input-major."""
        left, right = _jacobians(a).to(_F64), _jacobians(b).to(_F64)
        return flat_gram(left, right, self.prior_var)

    def self_gram(self, a: Pieces) -> torch.Tensor:
        """``(B C, B C)`` Gram of a batch with itself."""
        J = _jacobians(a).to(_F64)
        return flat_gram(J, J, self.prior_var)

    def diag(self, a: Pieces) -> torch.Tensor:
        """``(B, C, C)`` per-input blocks."""
        J = _jacobians(a).to(_F64)
        return torch.einsum("bcp,bep->bce", J * self.prior_var, J)

    @staticmethod
    def cat(parts: Sequence[Pieces]) -> torch.Tensor:
        """Concatenate pieces of consecutive batches."""
        return torch.cat([_jacobians(p) for p in parts])


@dataclass(frozen=True)
class FactorRoute:
    """Grams from the engine's per-layer factors (:mod:`.._factor_gram`)."""

    backend: JacobianBackend
    prior_var: torch.Tensor

    def pieces(self, x: torch.Tensor, graph: bool) -> JacobianFactors:
        """Factors of ``x`` ``(B, *input_shape)``; graph-connected if ``graph``."""
        if graph:
            return self.backend.jacobian_factors(x, enable_backprop=True)  # type: ignore[attr-defined]
        with torch.no_grad():
            parts = self.backend.jacobian_factors(x, enable_backprop=False)  # type: ignore[attr-defined]
            return parts.detach()

    def _gram(self, a: Pieces, b: Pieces) -> torch.Tensor:
        left = _factors(a).to(_F64)
        right = left if b is a else _factors(b).to(_F64)  # ``is``: symmetric
        K = factor_gram(left, right, list(self.backend.params), self.prior_var)
        B1, B2, C1, C2 = K.shape
        return K.permute(0, 2, 1, 3).reshape(B1 * C1, B2 * C2)

    def cross(self, a: Pieces, b: Pieces) -> torch.Tensor:
        """``(B1 C, B2 C)`` prior-scaled Gram, input-major."""
        return self._gram(a, b)

    def self_gram(self, a: Pieces) -> torch.Tensor:
        """``(B C, B C)`` Gram of a batch with itself."""
        return self._gram(a, a)

    def diag(self, a: Pieces) -> torch.Tensor:
        """``(B, C, C)`` per-input blocks."""
        wide = _factors(a).to(_F64)
        return factor_gram(wide, None, list(self.backend.params), self.prior_var)

    @staticmethod
    def cat(parts: Sequence[Pieces]) -> JacobianFactors:
        """Concatenate pieces of consecutive batches."""
        return JacobianFactors.cat([_factors(p) for p in parts])


Route = Union[StructuredRoute, FactorRoute, JacobianRoute]


def piece_tensors(p: Pieces) -> list[torch.Tensor]:
    """The floating tensors of pieces, in the order :func:`with_piece_tensors` takes.

    Returns
    -------
    list of torch.Tensor
    """
    if isinstance(p, torch.Tensor):
        return [p]
    if isinstance(p, JacobianFactors):
        return p.float_tensors()
    return [*p.inputs, *(g for g in p.signals if g is not None)]


def with_piece_tensors(p: Pieces, tensors: Sequence[torch.Tensor]) -> Pieces:
    """The same pieces made of ``tensors`` (as :func:`piece_tensors` lists them).

    Returns
    -------
    NTKFeatures, JacobianFactors or torch.Tensor
    """
    if isinstance(p, torch.Tensor):
        return tensors[0]
    if isinstance(p, JacobianFactors):
        return p.with_tensors(tensors)
    supply = iter(tensors)
    inputs = tuple(next(supply) for _ in p.inputs)
    signals = tuple(None if g is None else next(supply) for g in p.signals)
    return NTKFeatures(inputs, signals, p.weight, p.bias, p.n_outputs)


def _factors(p: Pieces) -> JacobianFactors:
    if not isinstance(p, JacobianFactors):
        raise TypeError("The factor route takes JacobianFactors pieces.")
    return p


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
    StructuredRoute, FactorRoute or JacobianRoute

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
    if structured is not False and factor_route_applies(backend):
        return FactorRoute(backend, prior_var)
    if structured:
        raise ValueError(
            "structured=True, but no structured route applies: it needs "
            "DiffBackPackGGN or DiffBackPackEF over all parameters (not "
            "last-layer or subnetwork), or an nn.Sequential chain of Linear layers "
            "and elementwise activations with a scalar prior; pass structured=None "
            "or False."
        )
    return JacobianRoute(backend, prior_var)
