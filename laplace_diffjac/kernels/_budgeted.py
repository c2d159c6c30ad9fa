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
3. Under autograd the chunked Gram is a :class:`torch.autograd.Function` that
   keeps no graph in its forward pass; its backward pass recomputes one row
   chunk's features with their graph at a time, sends the Gram's gradient to
   those features column chunk by column chunk, and only then back to the
   inputs and the parameters. That costs a second pass over the features, paid
   only when a gradient is asked for and the graph would not fit.

Results equal the unchunked route's: the same contractions, in chunks. The
recomputing route is differentiable once (``create_graph=True`` raises).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .._autograd_paths import reaches_leaf, tracked, used_by_this_pass
from ..budget import format_bytes, over_budget
from ..errors import MemoryBudgetError
from ._held_memory import held_bytes

__all__ = [
    "Costs",
    "Plan",
    "Route",
    "budgeted_diagonal",
    "budgeted_gram",
    "plan_diagonal",
    "plan_gram",
    "probe",
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


@dataclass
class _Run:
    """One budgeted Gram: the route, the plan and the inputs' layout."""

    route: Route
    plan: Plan
    symmetric: bool
    n_params: int


def _starts(n: int, chunk: int) -> list[slice]:
    return [slice(s, min(s + chunk, n)) for s in range(0, n, chunk)] or [slice(0, 0)]


def _column_features(run: _Run, x: Any) -> list[Features] | None:
    """The column chunks' features without graph, if the plan holds them."""
    if not run.plan.cache_columns:
        return None
    with torch.no_grad():
        return [
            run.route.features(take_inputs(x, s))
            for s in _starts(batch_of(x), run.plan.chunk)
        ]


def _columns(
    run: _Run, x: Any, held: list[Features] | None
) -> Iterator[tuple[slice, Features]]:
    """``(slice, features)`` of each column chunk, held or computed now."""
    for j, s in enumerate(_starts(batch_of(x), run.plan.chunk)):
        if held is not None:
            yield s, held[j]
        else:
            with torch.no_grad():
                feats = run.route.features(take_inputs(x, s))
            yield s, feats


def _forward_gram(
    run: _Run, x1: torch.Tensor, x2: torch.Tensor, prior_var: torch.Tensor
) -> torch.Tensor:
    """The Gram, row chunk by row chunk, without graph."""
    route, chunk = run.route, run.plan.chunk
    rows, cols = batch_of(x1), batch_of(x2)
    with torch.no_grad():
        held = _column_features(run, x2)
        out: torch.Tensor | None = None
        for rs in _starts(rows, chunk):
            left = route.features(take_inputs(x1, rs))
            for cs, right in _columns(run, x2, held):
                block = route.pair(left, right, prior_var)
                if out is None:
                    V1, V2 = block.shape[2:]
                    out = block.new_empty((rows, cols, V1, V2))
                out[rs, cs] = block
    assert out is not None
    return out


def _refuse_second_derivative() -> None:
    """Raise if the backward pass is asked for a graph (``create_graph=True``).

    Raises
    ------
    RuntimeError
        Naming the memory budget as the way to a second derivative.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            "This NTK was computed in chunks to stay within the memory budget and "
            "is differentiable once: its backward pass recomputes the chunks and "
            "keeps no graph of them, so create_graph=True (a second derivative) is "
            "not available. Raise the memory budget (laplace_diffjac."
            "set_memory_budget) until the NTK fits in one piece with its graph."
        )


class _RecomputedGram(torch.autograd.Function):
    """``K(x1, x2)`` with no graph kept; the backward pass recomputes features."""

    @staticmethod
    def forward(
        ctx: Any,
        run: _Run,
        x1: torch.Tensor,
        x2: torch.Tensor,
        prior_var: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.run = run
        ctx.save_for_backward(x1, x2, prior_var)
        ctx.params = params  # views of the parameters (``tracked``)
        return _forward_gram(run, x1, x2, prior_var)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _refuse_second_derivative()
        run: _Run = ctx.run
        x1, x2, prior_var = ctx.saved_tensors
        wants = ctx.needs_input_grad
        want_params = _wanted(wants[4:], ctx.params)
        totals = _Totals(len(want_params))
        if run.symmetric:
            sym = grad + grad.permute(1, 0, 3, 2)
            gx = _side(
                run,
                x1,
                x1,
                sym,
                prior_var,
                wants[1] or wants[2],
                want_params,
                wants[3],
                0.5,
                totals,
            )
            return (None, gx, None, totals.prior, *totals.params)
        gx1 = _side(
            run, x1, x2, grad, prior_var, wants[1], want_params, wants[3], 1.0, totals
        )
        gx2 = _side(
            run,
            x2,
            x1,
            grad.permute(1, 0, 3, 2),
            prior_var,
            wants[2],
            want_params,
            False,
            1.0,
            totals,
        )
        return (None, gx1, gx2, totals.prior, *totals.params)


def _wanted(needs: Sequence[bool], params: Sequence[torch.Tensor]) -> list[bool]:
    """The parameters whose gradients this backward pass uses.

    ``needs_input_grad`` marks every parameter that requires grad; of those, a
    pass such as ``torch.autograd.grad(K, x)`` uses none, and computing them
    would cost a pass through every layer's signals.

    Returns
    -------
    list of bool
        ``needs`` and :func:`used_by_this_pass` of the parameters' views.
    """
    return [n and u for n, u in zip(needs, used_by_this_pass(params))]


class _Totals:
    """Gradients of the parameters and the prior variance, summed over chunks."""

    def __init__(self, n_params: int) -> None:
        self.params: list[torch.Tensor | None] = [None] * n_params
        self.prior: torch.Tensor | None = None

    def add_params(
        self, grads: Sequence[torch.Tensor | None], where: Sequence[int]
    ) -> None:
        for i, g in zip(where, grads):
            if g is not None:
                held = self.params[i]
                self.params[i] = g if held is None else held + g

    def add_prior(self, g: torch.Tensor | None, scale: float) -> None:
        if g is not None:
            g = g * scale
            self.prior = g if self.prior is None else self.prior + g


def _side(
    run: _Run,
    rows: torch.Tensor,
    cols: torch.Tensor,
    grad: torch.Tensor,
    prior_var: torch.Tensor,
    want_x: bool,
    want_params: list[bool],
    want_prior: bool,
    prior_scale: float,
    totals: _Totals,
) -> torch.Tensor | None:
    """Gradients through the row side's features, the column side held constant.

    For each row chunk: its features with their graph; the Gram's gradient sent
    to those features (as leaves) one column chunk at a time; then one backward
    pass from the features to the chunk's inputs and the parameters.

    Returns
    -------
    torch.Tensor or None
        The gradient of the row inputs, if ``want_x``; the parameters' and the
        prior's go to ``totals``.
    """
    route = run.route
    params = [p for p, w in zip(route.params, want_params) if w]
    where = [i for i, w in enumerate(want_params) if w]
    grad_x = torch.zeros_like(rows) if want_x else None
    held = _column_features(run, cols)
    for rs in _starts(len(rows), run.plan.chunk):
        xr = rows[rs].detach().requires_grad_(want_x)
        with torch.enable_grad():
            feats = route.features(xr)
        tensors = route.tensors(feats)
        needed = [t.requires_grad for t in tensors]
        if not params:
            # Only the features whose graph reaches the inputs (the signals of a
            # piecewise-linear network hang on the weights alone), or none.
            reach = reaches_leaf(tensors, xr) if want_x else [False] * len(tensors)
            needed = [n and r for n, r in zip(needed, reach)]
        leaves = [t.detach().requires_grad_(n) for t, n in zip(tensors, needed)]
        leafy = route.rebuild(feats, leaves)
        pv = prior_var.detach().requires_grad_(want_prior)
        sums = _leaf_gradients(
            run, leafy, leaves, pv, grad[rs], cols, held, totals, prior_scale
        )
        outs = [
            (t, g) for t, g in zip(tensors, sums) if g is not None and t.requires_grad
        ]
        inputs = ([xr] if want_x else []) + params
        if outs and inputs:
            got = torch.autograd.grad(
                [t for t, _ in outs], inputs, [g for _, g in outs], allow_unused=True
            )
            if want_x and got[0] is not None:
                assert grad_x is not None
                grad_x[rs] = got[0]
            totals.add_params(got[1:] if want_x else got, where)
    return grad_x


def _leaf_gradients(
    run: _Run,
    leafy: Features,
    leaves: list[torch.Tensor],
    pv: torch.Tensor,
    grad_rows: torch.Tensor,
    cols: torch.Tensor,
    held: list[Features] | None,
    totals: _Totals,
    prior_scale: float,
) -> list[torch.Tensor | None]:
    """``∂⟨G, K⟩/∂F`` for a row chunk's features ``F``, column chunk by column chunk."""
    sums: list[torch.Tensor | None] = [None] * len(leaves)
    targets = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
    for cs, right in _columns(run, cols, held):
        with torch.enable_grad():
            block = run.route.pair(leafy, right, pv)
            scalar = (grad_rows[:, cs].to(block.dtype) * block).sum()
        wrt = [leaves[i] for i in targets] + ([pv] if pv.requires_grad else [])
        if not wrt or not scalar.requires_grad:
            continue
        got = torch.autograd.grad(scalar, wrt, allow_unused=True)
        for i, g in zip(targets, got):
            if g is not None:
                total = sums[i]
                sums[i] = g if total is None else total + g
        if pv.requires_grad:
            totals.add_prior(got[-1], prior_scale)
    return sums


def _diagonal_blocks(run: _Run, x: Any, prior_var: torch.Tensor) -> torch.Tensor:
    """Per-input Grams, chunk by chunk, with whatever graph grad mode keeps."""
    route = run.route
    parts = [
        route.pair(route.features(take_inputs(x, s)), None, prior_var)
        for s in _starts(batch_of(x), run.plan.chunk)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _RecomputedDiagonal(torch.autograd.Function):
    """Per-input Grams with no graph kept; the backward pass recomputes features."""

    @staticmethod
    def forward(
        ctx: Any,
        run: _Run,
        x: torch.Tensor,
        prior_var: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.run = run
        ctx.save_for_backward(x, prior_var)
        ctx.params = params  # views of the parameters (``tracked``)
        with torch.no_grad():
            return _diagonal_blocks(run, x, prior_var)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _refuse_second_derivative()
        run: _Run = ctx.run
        x, prior_var = ctx.saved_tensors
        wants = ctx.needs_input_grad
        route = run.route
        where = [i for i, w in enumerate(_wanted(wants[3:], ctx.params)) if w]
        params = [route.params[i] for i in where]
        totals = _Totals(len(wants) - 3)
        grad_x = torch.zeros_like(x) if wants[1] else None
        for s in _starts(len(x), run.plan.chunk):
            xs = x[s].detach().requires_grad_(wants[1])
            pv = prior_var.detach().requires_grad_(wants[2])
            with torch.enable_grad():
                block = route.pair(route.features(xs), None, pv)
                scalar = (grad[s].to(block.dtype) * block).sum()
            inputs = ([xs] if wants[1] else []) + ([pv] if wants[2] else []) + params
            if not inputs or not scalar.requires_grad:
                continue
            got = list(torch.autograd.grad(scalar, inputs, allow_unused=True))
            if wants[1]:
                g = got.pop(0)
                if g is not None:
                    assert grad_x is not None
                    grad_x[s] = g
            if wants[2]:
                totals.add_prior(got.pop(0), 1.0)
            totals.add_params(got, where)
        return (None, grad_x, totals.prior, *totals.params)


def budgeted_gram(
    route: Route,
    plan: Plan,
    x1: Any,
    x2: Any | None,
    prior_var: torch.Tensor,
    grad: bool,
) -> torch.Tensor:
    """The Gram in the plan's chunks; differentiable once when ``grad``.

    Parameters
    ----------
    route : Route
        The features and their Grams.
    plan : Plan
        From :func:`plan_gram`, with ``chunked=True``.
    x1 : torch.Tensor or mapping
        ``(B1, ...)``; a tensor when ``grad``.
    x2 : torch.Tensor, mapping or None
        ``(B2, ...)``; ``None`` for ``x1`` itself.
    prior_var : torch.Tensor
        ``()`` or ``(P,)``.
    grad : bool
        Whether a gradient may be asked for: the result is then connected to the
        inputs, the parameters and the prior variance.

    Returns
    -------
    torch.Tensor
        ``(B1, B2, V, V)``.

    Raises
    ------
    MemoryBudgetError
        If a gradient may be asked for and the inputs are a mapping: its chunks
        are recomputed from tensors only.

    """
    run = _Run(route, plan, x2 is None, len(route.params))
    other = x1 if x2 is None else x2
    if not grad:
        return _forward_gram(run, x1, other, prior_var)
    if not isinstance(x1, torch.Tensor) or not isinstance(other, torch.Tensor):
        raise MemoryBudgetError(
            "The NTK of these inputs does not fit the memory budget in one piece "
            "with its graph, and dict inputs cannot be recomputed in chunks for a "
            "gradient. Compute it under torch.no_grad(), "
            "pass a smaller batch, or raise the budget "
            "(laplace_diffjac.set_memory_budget)."
        )
    return _RecomputedGram.apply(run, x1, other, prior_var, *tracked(route.params))


def budgeted_diagonal(
    route: Route, plan: Plan, x: Any, prior_var: torch.Tensor, grad: bool
) -> torch.Tensor:
    """Per-input Grams ``(B, V, V)`` in the plan's chunks; differentiable once.

    Parameters
    ----------
    route : Route
        The features and their Grams.
    plan : Plan
        From :func:`plan_diagonal`, with ``chunked=True``.
    x : torch.Tensor or mapping
        ``(B, ...)``; a tensor when ``grad``.
    prior_var : torch.Tensor
        ``()`` or ``(P,)``.
    grad : bool
        Whether a gradient may be asked for, as for :func:`budgeted_gram`.

    Returns
    -------
    torch.Tensor
        ``(B, V, V)``.

    Raises
    ------
    MemoryBudgetError
        If a gradient may be asked for and the inputs are a mapping.

    """
    run = _Run(route, plan, True, len(route.params))
    if not grad:
        with torch.no_grad():
            return _diagonal_blocks(run, x, prior_var)
    if not isinstance(x, torch.Tensor):
        raise MemoryBudgetError(
            "ntk_diag of these inputs does not fit the memory budget in one piece "
            "with its graph, and dict inputs cannot be recomputed in chunks for a "
            "gradient. Compute it under torch.no_grad(), pass a smaller batch, or "
            "raise the budget (laplace_diffjac.set_memory_budget)."
        )
    return _RecomputedDiagonal.apply(run, x, prior_var, *tracked(route.params))
