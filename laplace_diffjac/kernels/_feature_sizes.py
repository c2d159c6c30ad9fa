"""What one input's kernel features hold, and what a Gram of two batches works in.

The memory budget (:mod:`laplace_diffjac.budget`) is met by sizing chunks from
these counts, taken once per model and input layout on one or two inputs:

* ``features``: one input's features (the engine's per-layer factors, or its
  Jacobian ``J``) held without a graph;
* ``graph``: the same with the autograd graph that computes them (what a
  gradient in the input keeps), as :func:`._budgeted.probe` counts it;
* ``transient``: one input's share of the peak while features are computed
  without a graph (the engine's activations and signals), estimated as
  ``graph`` times :data:`TRANSIENT_SCALE`;
* ``graph_gram(b1, b2)``: what the same Gram keeps for its backward pass when
  computed under autograd, as :func:`._budgeted.probe` counts it on Grams of one
  and two inputs (per input and per pair);
* ``gram(b1, b2)``: what a Gram of ``b1 × b2`` inputs holds beyond its operands,
  computed without a graph, counted from shapes:
  :func:`._factor_gram.gram_working_bytes` on one input's factors expanded to
  those batch sizes, or for ``J`` the prior-scaled copy of the first batch's
  Jacobians and the Gram.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..backends import JacobianBackend
from ._factor_gram import gram_working_bytes
from ._ntk import _budget_route, _costs, factor_route_applies

__all__ = ["TRANSIENT_SCALE", "FeatureSizes", "feature_sizes"]

#: A chunk's peak while its features are computed without a graph, as a multiple
#: of what its features hold with their graph (measured on the CIFAR ResNet of
#: ``benchmarks/context_posterior/context_budget.py``: 6.7 MiB of resident memory
#: per input against 5.8 MiB counted).
TRANSIENT_SCALE = 1.25


@dataclass(frozen=True)
class FeatureSizes:
    """What one input's features hold, and a Gram's working memory, in bytes.

    Attributes
    ----------
    features : float
        One input's features, held without graph.
    graph : float
        One input's features with the graph that computes them.
    transient : float
        One input's share of the peak while features are computed.
    gram : callable
        ``(b1, b2) ->`` bytes a Gram of ``b1 × b2`` inputs holds beyond its
        operands, without a graph.
    n_outputs : int
        ``C``.
    graph_gram : callable
        ``(b1, b2) ->`` bytes the same Gram keeps for its backward pass.
    contracted : float
        One input's features as contracted, in float64 (``features`` when they
        are held in float64).

    """

    features: float
    graph: float
    transient: float
    gram: Callable[[int, int], int]
    n_outputs: int
    graph_gram: Callable[[int, int], float]
    contracted: float


def feature_sizes(
    backend: JacobianBackend,
    x: torch.Tensor,
    factors: bool,
    held_dtype: torch.dtype = torch.float64,
) -> FeatureSizes:
    """Measure :class:`FeatureSizes` on the first (one or two) inputs of ``x``.

    Parameters
    ----------
    backend : JacobianBackend
        The backend whose features are counted.
    x : torch.Tensor
        ``(b, *input_shape)`` in the backend model's dtype and device, ``b ≥ 1``.
    factors : bool
        Per-layer factors where the backend has them; else Jacobians.
    held_dtype : torch.dtype, default=torch.float64
        The dtype features are held in; Grams are contracted in float64, from
        float64 copies made for each contraction (counted in ``gram`` and
        ``graph_gram``) when ``held_dtype`` is narrower.

    Returns
    -------
    FeatureSizes

    """
    factors = factors and factor_route_applies(backend)
    wide = torch.float64
    route = _budget_route(backend, factors, held_dtype, wide)
    prior_var = torch.ones((), dtype=wide, device=x.device)
    costs = _costs(backend, route, x[:2], prior_var, factors, held_dtype, wide)
    with torch.no_grad():
        one = route.features(x[:1])
    # a contraction's float64 copies of both sides' features
    contracted = costs.features * wide.itemsize / held_dtype.itemsize
    copy = 0.0 if held_dtype == wide else contracted
    if factors:
        parts = one
        C = parts.n_rows
        params = list(backend.params)

        def gram(b1: int, b2: int) -> int:
            left, right = parts.expanded(b1), parts.expanded(b2)
            working = gram_working_bytes(left, right, params, prior_var)
            return int(working + copy * (b1 + b2))

    else:
        C, width = one.shape[1], one.shape[-1]

        def gram(b1: int, b2: int) -> int:
            working = 8 * (b1 * C * width + 2 * b1 * b2 * C * C)
            return int(working + copy * (b1 + b2))

    transient = max(costs.graph, costs.features) * TRANSIENT_SCALE
    return FeatureSizes(
        costs.features, costs.graph, transient, gram, C, costs.pair, contracted
    )
