"""One batch's share of the Gram from the Jacobian engine: Linear features or factors.

The engine (:func:`laplace_diffjac.jacobians._engine.jacobian_factors`) walks the
model once per batch and gives every parameter's Jacobian as factors. Where all
of them are Linear layers applied to one feature vector per input (MLPs, whatever
their module structure) and the prior is a scalar, the factors are regrouped by
layer into :class:`~._structured_features.NTKFeatures`, whose Grams cost
``B1 B2 (width_in + C² width_out)`` per layer and have cheap backward passes;
otherwise they stay factors, contracted parameter by parameter
(:func:`~._factor_gram.factor_gram`). Either way ``J`` is never formed. A
caller asks for a batch's *pieces* and contracts two batches' pieces; which of
the two kinds they are follows from the model and the prior alone, so every
batch of one call gets the same kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, Union, cast

import torch

from ..backends import JacobianBackend
from ..jacobians._engine import JacobianFactors, jacobian_factors, jacobian_pieces
from ..jacobians._linear_layers import LinearSignals
from ._factor_gram import factor_gram
from ._structured import supports_structured_ntk
from ._structured_features import (
    NTKFeatures,
    feature_diag,
    feature_gram,
    features_of,
)

#: What :func:`engine_pieces` gives for one batch.
EnginePieces = Union[NTKFeatures, JacobianFactors]

__all__ = [
    "EnginePieces",
    "factor_route_applies",
    "engine_factors",
    "engine_pieces",
    "linear_pieces",
    "pieces_diag",
    "pieces_gram",
]


class _FactorBackend(Protocol):
    """A backend that hands out the per-layer factors of its Jacobians."""

    def jacobian_factors(self, x: Any, enable_backprop: bool = False) -> Any: ...


def _factor_source(backend: object) -> _FactorBackend | None:
    """``backend`` as a :class:`_FactorBackend` if it is one, else ``None``.

    The structural check ``isinstance`` makes of a runtime-checkable protocol,
    without its cost (several microseconds a call, twice in every ``ntk``).

    Returns
    -------
    _FactorBackend or None
    """
    if callable(getattr(backend, "jacobian_factors", None)):
        return cast(_FactorBackend, backend)
    return None


def factor_route_applies(backend: JacobianBackend) -> bool:
    """Whether the engine's factors give this backend's Jacobians.

    Parameters
    ----------
    backend : JacobianBackend
        The backend whose Jacobians a Gram would contract.

    Returns
    -------
    bool
        ``True`` for ``DiffBackPackGGN`` and ``DiffBackPackEF`` over all their
        parameters (neither last-layer nor subnetwork), and for any other
        backend whose model is an ``nn.Sequential`` chain of Linear layers and
        elementwise activations (:func:`~._structured.supports_structured_ntk`)
        with the Jacobian taken in all its trainable parameters.

    """
    if getattr(backend, "last_layer", False):
        return False
    if getattr(backend, "subnetwork_indices", None) is not None:
        return False
    if _factor_source(backend) is not None:
        return True
    return supports_structured_ntk(backend.model, list(backend.params))


def engine_factors(backend: JacobianBackend, x: Any, graph: bool) -> JacobianFactors:
    """The engine's factors of a batch ``x`` (:func:`factor_route_applies` holds).

    Parameters
    ----------
    backend : JacobianBackend
        Its own ``jacobian_factors`` where it has one, else the engine over its
        model and parameters.
    x : torch.Tensor or Mapping
        ``(B, *input_shape)``.
    graph : bool
        Keep the factors connected to the graph of ``x`` and the parameters.

    Returns
    -------
    JacobianFactors
        Detached unless ``graph``.
    """
    source = _factor_source(backend)
    if source is not None:
        return source.jacobian_factors(x, enable_backprop=graph)
    return jacobian_factors(
        backend.model, x, list(backend.params), enable_backprop=graph
    )


def engine_pieces(
    backend: JacobianBackend,
    x: Any,
    graph: bool,
    regroup: bool,
    dtype: torch.dtype | None = None,
) -> EnginePieces:
    """A batch's pieces: Linear features where they apply, else the factors.

    Parameters
    ----------
    backend : JacobianBackend
        A backend :func:`factor_route_applies` to.
    x : torch.Tensor or Mapping
        ``(B, *input_shape)``.
    graph : bool
        Keep the pieces connected to the graph of ``x`` and the parameters.
    regroup : bool
        Regroup Linear layers' factors into features where they all are (the
        features' Grams need a scalar prior).
    dtype : torch.dtype, optional
        Cast the pieces to it (after regrouping, which needs the engine's views).

    Returns
    -------
    NTKFeatures or JacobianFactors
    """
    pieces = (
        _regrouped(backend, x, graph) if regroup else engine_factors(backend, x, graph)
    )
    return pieces if dtype is None else pieces.to(dtype)


def _regrouped(backend: JacobianBackend, x: Any, graph: bool) -> EnginePieces:
    """A batch's Linear features where they apply, else its factors.

    Returns
    -------
    NTKFeatures or JacobianFactors
    """
    raw = linear_pieces(backend, x, graph)
    features = features_of(raw, list(backend.params))
    if features is not None:
        return features
    assert isinstance(raw, JacobianFactors)  # Linear layers always regroup
    return raw


def linear_pieces(
    backend: JacobianBackend, x: Any, graph: bool
) -> LinearSignals | JacobianFactors:
    """A batch's Linear layers' inputs and signals where they all are, else factors.

    From the backend's ``jacobian_pieces`` where it has one, else from the
    engine over its model (either gives the Linear layers' inputs and signals
    straight off the pass where every parameter is a Linear layer's); from a
    backend with factors only, those factors.

    Parameters
    ----------
    backend : JacobianBackend
        A backend :func:`factor_route_applies` to.
    x : torch.Tensor or Mapping
        ``(B, *input_shape)``.
    graph : bool
        Keep the pieces connected to the graph of ``x`` and the parameters.

    Returns
    -------
    LinearSignals or JacobianFactors
        Both carry the model's output ``f``.
    """
    source = getattr(backend, "jacobian_pieces", None)
    if callable(source):
        return source(x, enable_backprop=graph)
    if _factor_source(backend) is not None:
        return engine_factors(backend, x, graph)
    return jacobian_pieces(
        backend.model, x, list(backend.params), enable_backprop=graph
    )


def pieces_gram(
    left: EnginePieces,
    right: EnginePieces,
    params: Sequence[torch.Tensor],
    prior_var: torch.Tensor,
) -> torch.Tensor:
    """``J(x1) Σ₀ J(x2)ᵀ`` ``(B1, B2, V, V)`` of two batches' pieces of one kind.

    Returns
    -------
    torch.Tensor
        ``(B1, B2, V, V)``, laplace-torch's kernel layout; differentiable (twice
        through features, as through factors).
    """
    if isinstance(left, NTKFeatures):
        assert isinstance(right, NTKFeatures)
        n1, n2, c = len(left), len(right), left.n_outputs
        flat = feature_gram(left, right, prior_var)
        return flat.view(n1, c, n2, c).permute(0, 2, 1, 3)
    assert isinstance(right, JacobianFactors)
    return factor_gram(left, right, params, prior_var)


def pieces_diag(
    pieces: EnginePieces, params: Sequence[torch.Tensor], prior_var: torch.Tensor
) -> torch.Tensor:
    """The per-input blocks ``J(xₙ) Σ₀ J(xₙ)ᵀ`` ``(B, V, V)`` of a batch's pieces.

    Returns
    -------
    torch.Tensor
        ``(B, V, V)``.
    """
    if isinstance(pieces, NTKFeatures):
        return feature_diag(pieces, prior_var)
    return factor_gram(pieces, None, params, prior_var)
