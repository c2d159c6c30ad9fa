"""Two ways to get the objective's Grams: the engine's pieces or Jacobians.

A route turns inputs into *pieces* (one side's share of the kernel) and contracts
two sides' pieces into a Gram. The training side's pieces do not depend on the
locations, so the optimiser computes them once and reuses them at every step:

* :class:`FactorRoute` (``DiffBackPackGGN``/``DiffBackPackEF`` over all
  parameters, any module structure, any prior; any backend's ``nn.Sequential``
  chain of Linear layers and elementwise activations): the pieces come from the
  Jacobian engine (:mod:`laplace_diffjac.kernels._engine_pieces`), never ``J``.
  Where every parameter is a Linear layer's and the prior a scalar they are
  :class:`~laplace_diffjac.kernels._structured_features.NTKFeatures`,
  ``B (width_in + C width_out)`` numbers per layer, whose Grams have the cheap
  backward passes of :mod:`~laplace_diffjac.kernels._cross_gram` and
  :mod:`~laplace_diffjac.kernels._symmetric_gram`; otherwise the per-layer
  factors (:class:`~laplace_diffjac.jacobians._engine.JacobianFactors`),
  contracted layer by layer (:func:`laplace_diffjac.kernels._factor_gram.factor_gram`);
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
from ...kernels._engine_pieces import engine_pieces, factor_route_applies
from ...kernels._factor_gram import factor_gram
from ...kernels._ntk import flat_gram, prior_variance
from ...kernels._structured_features import NTKFeatures, feature_diag
from ...kernels._symmetric_gram import symmetric_feature_gram

Pieces = Union[NTKFeatures, JacobianFactors, torch.Tensor]
_F64 = torch.float64

__all__ = [
    "FactorRoute",
    "JacobianRoute",
    "Pieces",
    "Route",
    "make_route",
    "piece_tensors",
    "with_piece_tensors",
]


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
    """Grams from the Jacobian engine's pieces: Linear features or factors."""

    backend: JacobianBackend
    prior_var: torch.Tensor

    def pieces(self, x: torch.Tensor, graph: bool) -> NTKFeatures | JacobianFactors:
        """Pieces of ``x`` ``(B, *input_shape)``; graph-connected if ``graph``."""
        regroup = self.prior_var.dim() == 0
        with nullcontext() if graph else torch.no_grad():
            return engine_pieces(self.backend, x, graph, regroup)

    def _gram(self, a: Pieces, b: Pieces) -> torch.Tensor:
        left = _factors(a).to(_F64)
        right = left if b is a else _factors(b).to(_F64)  # ``is``: symmetric
        K = factor_gram(left, right, list(self.backend.params), self.prior_var)
        B1, B2, C1, C2 = K.shape
        return K.permute(0, 2, 1, 3).reshape(B1 * C1, B2 * C2)

    def cross(self, a: Pieces, b: Pieces) -> torch.Tensor:
        """``(B1 C, B2 C)`` prior-scaled Gram, input-major (``b`` usually detached)."""
        if isinstance(a, NTKFeatures):
            left, right = a.to(_F64), _features(b).to(_F64)
            return cross_feature_gram(left, right, self.prior_var)
        return self._gram(a, b)

    def self_gram(self, a: Pieces) -> torch.Tensor:
        """``(B C, B C)`` Gram of a batch with itself, for a symmetric consumer."""
        if isinstance(a, NTKFeatures):
            return symmetric_feature_gram(a.to(_F64), self.prior_var)
        return self._gram(a, a)

    def diag(self, a: Pieces) -> torch.Tensor:
        """``(B, C, C)`` per-input blocks."""
        if isinstance(a, NTKFeatures):
            return feature_diag(a.to(_F64), self.prior_var)
        wide = _factors(a).to(_F64)
        return factor_gram(wide, None, list(self.backend.params), self.prior_var)

    @staticmethod
    def cat(parts: Sequence[Pieces]) -> NTKFeatures | JacobianFactors:
        """Concatenate pieces of consecutive batches."""
        if isinstance(parts[0], NTKFeatures):
            return NTKFeatures.cat([_features(p) for p in parts])
        return JacobianFactors.cat([_factors(p) for p in parts])


Route = Union[FactorRoute, JacobianRoute]


def piece_tensors(p: Pieces) -> list[torch.Tensor]:
    """The floating tensors of pieces, in the order :func:`with_piece_tensors` takes.

    Returns
    -------
    list of torch.Tensor
    """
    if isinstance(p, torch.Tensor):
        return [p]
    return p.float_tensors()


def with_piece_tensors(p: Pieces, tensors: Sequence[torch.Tensor]) -> Pieces:
    """The same pieces made of ``tensors`` (as :func:`piece_tensors` lists them).

    Returns
    -------
    NTKFeatures, JacobianFactors or torch.Tensor
    """
    if isinstance(p, torch.Tensor):
        return tensors[0]
    return p.with_tensors(tensors)


def _factors(p: Pieces) -> JacobianFactors:
    if not isinstance(p, JacobianFactors):
        raise TypeError("The factor route takes JacobianFactors pieces.")
    return p


def _features(p: Pieces) -> NTKFeatures:
    if not isinstance(p, NTKFeatures):
        raise TypeError("Linear features pair only with Linear features.")
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
        ``None``: the engine's pieces where they apply, else Jacobians; ``True``:
        require them; ``False``: always Jacobians.
    device : torch.device
        Device of the model.

    Returns
    -------
    FactorRoute or JacobianRoute

    Raises
    ------
    ValueError
        If ``structured=True`` but the route does not apply, or the prior
        precision has the wrong size or is not positive.

    """
    like = torch.empty((), dtype=_F64, device=device)
    prior_var = prior_variance(prior_precision, n_jacobian_columns(backend), like)
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
