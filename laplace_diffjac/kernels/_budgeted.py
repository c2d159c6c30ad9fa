"""The NTK within the memory budget: chunks sized by a probe, recomputed for gradients.

:func:`laplace_diffjac.ntk` builds ``K = J(x1) Σ₀ J(x2)ᵀ`` from per-chunk
*features* (the engine's per-layer factors, or the Jacobians themselves). Held
all at once with their autograd graph, those features grow with the batch: on a
CIFAR ResNet-18 (``C = 10``) a batch of 64 holds tens of GiB. This module keeps
what is held at once within :func:`laplace_diffjac.budget.get_memory_budget`:

1. A **probe** computes the features of two inputs with their graph, and two
   small Grams of them, and counts the bytes each holds on the graph
   (:mod:`._held_memory`): features per input, features plus graph per input,
   and a Gram's intermediates as ``α (b1 + b2) + β b1 b2``.
2. A **plan** takes everything at once when that fits (the route of
   :mod:`._ntk`, unchanged). Otherwise it takes row chunks of ``c`` inputs, the
   largest ``c`` that fits, holding the column side's features (without graph)
   when they fit in half the budget and recomputing them per row otherwise.
3. Under autograd the chunked Gram (:mod:`._chunked_gram`) is a
   :class:`torch.autograd.Function` that keeps no graph in its forward pass;
   its backward pass recomputes one row chunk's features with their graph at a
   time, sends the Gram's gradient to those features column chunk by column
   chunk, and only then back to the inputs and the parameters. That costs a
   second pass over the features, paid only when a gradient is asked for and
   the graph would not fit.

Results equal the unchunked route's: the same contractions, in chunks. The
recomputing route is differentiable once (``create_graph=True`` raises).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..budget import format_bytes, over_budget
from ..errors import MemoryBudgetError
from ._held_memory import held_bytes

__all__ = [
    "Costs",
    "Features",
    "Plan",
    "Route",
    "batch_of",
    "chunk_needs",
    "plan_diagonal",
    "plan_gram",
    "probe",
    "take_inputs",
]

Features = Any


@dataclass(frozen=True)
class Route:
    """How one route turns a chunk of inputs into features and features into Grams.

    Attributes
    ----------
    features : callable
        ``x -> F`` for a chunk ``x``; with a graph when gradients are enabled.
    pair : callable
        ``(F1, F2, prior_var) -> (b1, b2, V, V)``, or ``(b1, V, V)`` for
        ``F2 = None`` (each input with itself).
    tensors : callable
        ``F ->`` its floating tensors, in the order ``rebuild`` takes.
    rebuild : callable
        ``(F, tensors) ->`` the same features made of ``tensors``.
    take : callable
        ``(F, slice) ->`` the features of those inputs.
    exclude : sequence of torch.Tensor
        Tensors a probe does not count (the parameters).
    params : sequence of torch.Tensor
        The parameters the features depend on, for their gradients.
    backward_scale : float
        What one row input holds in the backward pass, as a multiple of the
        features and graph the probe counts: 1 for the per-layer factors
        (measured: the budget's peaks stay within it); 4 for assembled Jacobians,
        whose backward pass through the assembly and the engine's double backward
        holds J-sized gradients the graph does not show (measured on the CIFAR
        ResNet of ``benchmarks/jacobians/ntk_budget.py``: 1.42 GiB a row input
        against 0.37 GiB counted).

    """

    features: Callable[[Any], Features]
    pair: Callable[[Features, Features | None, torch.Tensor], torch.Tensor]
    tensors: Callable[[Features], list[torch.Tensor]]
    rebuild: Callable[[Features, Sequence[torch.Tensor]], Features]
    take: Callable[[Features, slice], Features]
    exclude: Sequence[torch.Tensor]
    params: Sequence[torch.Tensor]
    backward_scale: float = 1.0


@dataclass(frozen=True)
class Costs:
    """Bytes held, measured by :func:`probe`.

    Attributes
    ----------
    features : float
        Features of one input, without graph.
    graph : float
        Features of one input with their autograd graph.
    pair_sum : float
        ``α``: a Gram's intermediates per input of either side.
    pair_product : float
        ``β``: a Gram's intermediates per pair of inputs.
    diagonal : float
        A per-input Gram's intermediates per input.

    """

    features: float
    graph: float
    pair_sum: float
    pair_product: float
    diagonal: float

    def pair(self, b1: int, b2: int) -> float:
        """Bytes a Gram of ``b1 × b2`` inputs holds beyond its operands."""
        return self.pair_sum * (b1 + b2) + self.pair_product * b1 * b2


@dataclass(frozen=True)
class Plan:
    """How a Gram is computed within the budget.

    Attributes
    ----------
    chunk : int
        Inputs per row (and column) chunk.
    chunked : bool
        ``False``: everything at once, as without a budget.
    cache_columns : bool
        Hold the column side's features (without graph) across rows.
    needs : float
        Bytes the plan holds at once, as the probe predicts.

    """

    chunk: int
    chunked: bool
    cache_columns: bool
    needs: float


def batch_of(x: Any) -> int:
    """Inputs in a batch: a tensor's first dimension, or a mapping's values'."""
    if isinstance(x, Mapping):
        return int(len(next(iter(x.values()))))
    return int(x.shape[0])


def take_inputs(x: Any, where: slice) -> Any:
    """The inputs ``where`` selects, of a tensor or a mapping of tensors."""
    if isinstance(x, Mapping):
        return type(x)({k: v[where] for k, v in x.items()})  # type: ignore[call-arg]
    return x[where]


def probe(route: Route, x: Any, prior_var: torch.Tensor) -> Costs:
    """Measure what features and Grams hold, on the first one or two inputs.

    Parameters
    ----------
    route : Route
        The route to measure.
    x : torch.Tensor or mapping
        A batch; its first ``min(2, B)`` inputs are used.
    prior_var : torch.Tensor
        ``()`` or ``(P,)`` prior variance.

    Returns
    -------
    Costs
        Per-input and per-pair bytes.

    """
    b = min(2, batch_of(x))
    xs = take_inputs(x, slice(0, b))
    if isinstance(xs, torch.Tensor):
        xs = xs.detach().requires_grad_(xs.is_floating_point())
    inputs = list(xs.values()) if isinstance(xs, Mapping) else [xs]
    exclude = [*route.exclude, *inputs, prior_var]
    with torch.enable_grad():
        feats = route.features(xs)
        tensors = route.tensors(feats)
        graph = held_bytes(tensors, exclude)
        own = held_bytes([t.detach() for t in tensors], exclude)
        leaves = [t.detach().requires_grad_() for t in tensors]
        leafy = route.rebuild(feats, leaves)
        del feats, tensors
        pv = prior_var.detach().requires_grad_()
        exclude = [*exclude, *leaves, pv]
        one = route.take(leafy, slice(0, 1))
        g11 = held_bytes([route.pair(one, one, pv)], exclude)
        diagonal = held_bytes([route.pair(leafy, None, pv)], exclude) / b
        if b == 2:
            g22 = held_bytes([route.pair(leafy, leafy, pv)], exclude)
            beta = max(0.0, (g22 - 2 * g11) / 2)
            alpha = max(0.0, (g11 - beta) / 2)
        else:
            alpha, beta = g11 / 2, 0.0
    return Costs(own / b, graph / b, alpha, beta, diagonal)


def plan_gram(
    costs: Costs,
    sizes: tuple[int, int],
    symmetric: bool,
    grad: bool,
    budget: int,
    max_chunk: int,
    backward_scale: float = 1.0,
) -> Plan:
    """The largest chunks of a ``B1 × B2`` Gram that fit ``budget`` bytes.

    Parameters
    ----------
    costs : Costs
        From :func:`probe`.
    sizes : tuple of int
        ``(B1, B2)``.
    symmetric : bool
        Whether the columns are the rows' inputs (their features are shared).
    grad : bool
        Whether a gradient may be asked for (the graph is held or recomputed).
    budget : int
        Bytes.
    max_chunk : int
        The caller's ``chunk_size``: no chunk is larger.
    backward_scale : float, default=1.0
        The route's :attr:`Route.backward_scale`.

    Returns
    -------
    Plan
        Everything at once if it fits, else the largest row chunk that does.

    Raises
    ------
    MemoryBudgetError
        If one input per chunk does not fit.

    """
    rows, cols = sizes
    per_input = costs.graph * backward_scale if grad else costs.features
    first = min(max_chunk, rows, cols)
    gram = costs.pair(rows, cols) if grad else costs.pair(first, first)
    whole = per_input * (rows + (0 if symmetric else cols)) + gram
    if whole <= budget:
        return Plan(max_chunk, False, True, whole)

    needs = partial(_needs, costs, sizes, grad, backward_scale)

    for cache in (costs.features * cols <= budget / 2, False):
        chunk = _largest(
            partial(_fits, needs, cache, budget), max(rows, cols), max_chunk
        )
        if chunk:
            return Plan(chunk, True, cache, needs(chunk, cache))
    raise MemoryBudgetError(
        over_budget(
            f"ntk of {rows} × {cols} inputs{' with its gradient' if grad else ''}",
            int(needs(1, False)),
            budget,
            f"One input's features take {format_bytes(per_input)}"
            f"{' with their graph' if grad else ''}.",
        )
    )


def plan_diagonal(
    costs: Costs,
    size: int,
    grad: bool,
    budget: int,
    max_chunk: int,
    backward_scale: float = 1.0,
) -> Plan:
    """The largest chunk of :func:`laplace_diffjac.ntk_diag` that fits ``budget``.

    Parameters
    ----------
    costs : Costs
        From :func:`probe`.
    size : int
        ``B``.
    grad : bool
        Whether a gradient may be asked for.
    budget : int
        Bytes.
    max_chunk : int
        The caller's ``chunk_size``.
    backward_scale : float, default=1.0
        The route's :attr:`Route.backward_scale`.

    Returns
    -------
    Plan
        As for :func:`plan_gram`.

    Raises
    ------
    MemoryBudgetError
        If one input does not fit.

    """
    graph = costs.graph * backward_scale
    per_input = (graph if grad else costs.features) + costs.diagonal
    if per_input * size <= budget:
        return Plan(max_chunk, False, False, per_input * size)
    chunk = _largest(lambda c: per_input * c <= budget, size, max_chunk)
    if not chunk:
        raise MemoryBudgetError(
            over_budget(
                f"ntk_diag of {size} inputs{' with its gradient' if grad else ''}",
                int(per_input),
                budget,
                "Not even one input fits.",
            )
        )
    return Plan(chunk, True, False, per_input * chunk)


def chunk_needs(
    costs: Costs,
    sizes: tuple[int, int],
    grad: bool,
    chunk: int,
    cache: bool,
    backward_scale: float = 1.0,
) -> float:
    """Bytes a chunked Gram holds at once, forward and (with ``grad``) backward.

    Parameters
    ----------
    costs : Costs
        From :func:`probe`.
    sizes : tuple of int
        ``(B1, B2)``.
    grad : bool
        Whether the backward pass recomputes a row chunk's graph.
    chunk : int
        Inputs per chunk.
    cache : bool
        Whether the column side's features are held across rows.
    backward_scale : float, default=1.0
        The route's :attr:`Route.backward_scale`.

    Returns
    -------
    float
        A row chunk's features (with graph and their gradient, backward), the
        column features held, and one block's Gram intermediates.

    """
    rows, cols = sizes
    r, k = min(chunk, rows), min(chunk, cols)
    held = costs.features * (cols if cache else k)
    forward = costs.features * r + held + costs.pair(r, k)
    if not grad:
        return forward
    per_row = (costs.graph + costs.features) * backward_scale
    backward = per_row * r + held + costs.pair(r, k)
    return max(forward, backward)


def _needs(
    costs: Costs,
    sizes: tuple[int, int],
    grad: bool,
    backward_scale: float,
    chunk: int,
    cache: bool,
) -> float:
    return chunk_needs(costs, sizes, grad, chunk, cache, backward_scale)


def _fits(
    needs: Callable[[int, bool], float], cache: bool, budget: int, c: int
) -> bool:
    return needs(c, cache) <= budget


def _largest(fits: Callable[[int], bool], n: int, cap: int) -> int:
    """The largest ``c`` in ``1..min(n, cap)`` with ``fits(c)`` (0 if none)."""
    lo, hi = 0, max(1, min(n, cap))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
