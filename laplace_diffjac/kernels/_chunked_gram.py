"""The budgeted NTK's chunks, computed, and for a gradient recomputed.

The chunks are never held with their graph.
:mod:`._budgeted` plans the chunks; this module runs a plan. Without a gradient
the Gram is filled block by block under ``torch.no_grad()``. With one, it is a
:class:`torch.autograd.Function` whose forward pass keeps no graph; its backward
pass recomputes one row chunk's features with their graph at a time, sends the
Gram's gradient to those features column chunk by column chunk, and only then
back to the inputs and the parameters, and only to those that the running
backward pass uses (:mod:`laplace_diffjac._autograd_paths`). The result is
differentiable once (``create_graph=True`` raises).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._autograd_paths import reaches_leaf, tracked, used_by_this_pass
from ..errors import MemoryBudgetError
from ._budgeted import Features, Plan, Route, batch_of, take_inputs

__all__ = ["budgeted_diagonal", "budgeted_gram"]


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
