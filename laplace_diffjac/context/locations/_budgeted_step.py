"""A location step within the memory budget: Grams without a graph, then recomputation.

A step's objective, the minibatch's Nyström gap
``G(Z) = Σₙ tr(Λₙ kₙₙ) − explained_trace(K_ZZ, K_ZX, Λ)`` (:mod:`._gap`),
depends on the locations only through ``K_ZZ`` and ``K_ZX``. Computed with their
graphs, the locations' features and every Gram's saved intermediates are held
until the backward pass: tens of GiB on a CIFAR ResNet-18. When that does not fit
the memory budget (:mod:`laplace_diffjac.budget`), a step instead

1. computes ``K_ZZ`` and ``K_ZX`` without a graph, the locations in blocks of
   ``z`` (their features held without a graph when they fit, else computed
   again for each use), each block against the minibatch in column blocks of
   ``w`` inputs (the per-pair intermediates of a Gram grow with ``z·w``);
2. differentiates ``G`` with ``K_ZZ`` and ``K_ZX`` as leaves, giving ``∂G/∂K``
   (``(MC)²`` and ``MC × bC`` numbers);
3. for each block of locations, computes its features again with their graph,
   sends ``⟨∂G/∂K, K⟩`` to those features (as leaves) one column block at a time
   (the other blocks of locations with weight ``∂G/∂K_ZZ + ∂G/∂K_ZZᵀ``, the
   minibatch's chunks with ``∂G/∂K_ZX``), and then runs one backward pass from
   the features to the block's locations.

Value and gradient are the whole step's, summed in another order; the cost is a
second pass over the locations' features (a third where they are not held).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from ..._autograd_paths import reaches_leaf
from ...budget import format_bytes, over_budget
from ...errors import MemoryBudgetError
from ...jacobians._engine import JacobianFactors
from ...kernels import explained_trace
from ...kernels._feature_sizes import FeatureSizes, feature_sizes
from ..posterior._chunks import largest_fitting
from ._routes import JacobianRoute, Pieces, Route, piece_tensors, with_piece_tensors

__all__ = ["StepPlan", "budgeted_gap", "feature_chunk", "plan_step", "route_sizes"]

_F64 = torch.float64


@dataclass(frozen=True)
class StepPlan:
    """How a step is computed within the budget.

    Attributes
    ----------
    block : int
        Locations per block.
    hold : bool
        The locations' features (without graph) are held through the step.
    whole : bool
        Everything at once with its graph (the unbudgeted step).
    needs : int
        Bytes held at once, as counted.
    hold_batch : bool, default=True
        The minibatch's features (without graph) are held through the step;
        ``False``: each use computes its chunk's features again
        (:class:`._batch_pieces.RecomputedPieces`).
    width : int, optional
        Minibatch inputs per column block of a Gram against a block of
        locations; ``None``: each chunk of the minibatch whole.

    """

    block: int
    hold: bool
    whole: bool
    needs: int
    hold_batch: bool = True
    width: int | None = None


def plan_step(
    sizes: FeatureSizes, n_locations: int, batch: int, chunk: int, budget: int
) -> StepPlan:
    """The blocks of locations and columns whose step fits ``budget`` bytes.

    Counted: the step's ``(MC)²`` and ``MC × bC`` matrices and their gradients
    (four of each), the minibatch's features (held, or one chunk's at a time
    while it is computed again for each use), and per plan the locations'
    features (with their graph for the whole step; without, held or recomputed,
    otherwise) and the Grams' working memory: every Gram's graph, kept for the
    backward pass, in the whole step (``sizes.graph_gram``); otherwise one
    block of ``z`` locations against one column block (another block of
    locations, or ``w`` of the minibatch's inputs), the larger of its working
    memory without a graph (``sizes.gram``, the Grams' pass) and its graph (the
    gradient's pass).

    Holding features comes first: the minibatch's (else it is computed again
    once per block of locations and pass), then the locations' (else once per
    pair of blocks). Among the ``(z, w)`` that fit with the most held, the plan
    makes the fewest Gram calls (:func:`_gram_calls`): the work is the same
    multiply-adds in every plan, and each call pays its layers' launches and a
    float64 copy of its operands.

    Parameters
    ----------
    sizes : FeatureSizes
        Of the route's features.
    n_locations : int
        ``M``.
    batch : int
        The minibatch's inputs ``b``.
    chunk : int
        Inputs per chunk of the minibatch's features.
    budget : int
        Bytes left to the step (the training cache's held features not included).

    Returns
    -------
    StepPlan

    Raises
    ------
    MemoryBudgetError
        If a block of one location against one input does not fit.

    """
    M, C = n_locations, sizes.n_outputs
    chunk = max(1, min(chunk, batch))
    matrices = 8.0 * 4 * (M * C) * (M * C + batch * C)
    held_batch = batch * sizes.features
    one_chunk = chunk * (sizes.features + sizes.transient)
    grams = sizes.graph_gram(M, M) + sizes.graph_gram(M, batch)
    whole = matrices + held_batch + M * sizes.graph + grams
    if whole <= budget:
        return StepPlan(M, True, True, int(whole))

    def needs(z: int, w: int, hold: bool, hold_batch: bool) -> float:
        minibatch = held_batch if hold_batch else one_chunk
        held = M * sizes.features if hold else z * (sizes.transient + sizes.features)
        rows = z * (sizes.graph + sizes.contracted + sizes.transient)
        columns = max(z, w)
        block = max(sizes.gram(z, columns), sizes.graph_gram(z, columns))
        return matrices + minibatch + held + rows + block

    # every number of blocks of locations once: z = ⌈M/k⌉
    blocks = sorted({-(-M // k) for k in range(1, M + 1)}, reverse=True)
    for hold_batch, hold in (
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    ):
        fitting = []
        for z in blocks:
            w = largest_fitting(
                partial(_fits, needs, z, hold, hold_batch, budget), chunk
            )
            if w:
                fitting.append((_gram_calls(M, batch, chunk, z, w), -z, w))
        if fitting:
            _, z, w = min(fitting)
            z = -z
            width = None if w >= chunk else w
            need = int(needs(z, w, hold, hold_batch))
            return StepPlan(z, hold, False, need, hold_batch, width)
    raise MemoryBudgetError(
        over_budget(
            f"A location step with {M} locations and a minibatch of {batch}",
            int(needs(1, 1, False, False)),
            budget,
            f"One input's features take {format_bytes(sizes.features)} "
            f"({format_bytes(sizes.graph)} with their graph); the step's matrices "
            f"{format_bytes(matrices)}. Fewer locations or a smaller batch_size fit.",
        )
    )


def _gram_calls(M: int, batch: int, chunk: int, z: int, w: int) -> int:
    """Gram calls of a step in blocks of ``z`` locations and columns of ``w`` inputs.

    The Grams' pass: ``n(n+1)/2`` blocks of ``K_ZZ`` and ``n·m`` of ``K_ZX``; the
    gradient's pass: ``n`` sends for each of the ``n`` blocks and ``m`` columns,
    and ``n`` backward passes (``n`` blocks of locations, ``m`` column blocks).

    Returns
    -------
    int
    """
    n = -(-M // z)
    m = -(-batch // chunk) * -(-min(chunk, batch) // w)
    return n * (n + 1) // 2 + n * m + n * (n + m) + n


def route_sizes(route: Route, x: torch.Tensor) -> FeatureSizes:
    """:class:`FeatureSizes` of a route's pieces, measured on ``x[:2]``.

    The structured route's features are counted as the per-layer factors they
    are a special case of (where the backend has factors), else as Jacobians;
    held in the model's dtype, contracted in float64 (:mod:`._routes`).

    Returns
    -------
    FeatureSizes
    """
    held = next(iter(route.backend.model.parameters())).dtype
    factors = not isinstance(route, JacobianRoute)
    return feature_sizes(route.backend, x[:2], factors, held)


def feature_chunk(sizes: FeatureSizes, chunk: int, budget: int) -> int:
    """Inputs per chunk of features computed without graph: a quarter of the budget.

    Returns
    -------
    int
        At most ``chunk``, at least 1.
    """
    return max(1, min(chunk, int(budget / 4 // max(sizes.transient, 1.0))))


def _fits(
    needs: Callable[[int, int, bool, bool], float],
    z: int,
    hold: bool,
    hold_batch: bool,
    budget: int,
    w: int,
) -> bool:
    return needs(z, w, hold, hold_batch) <= budget


class _Blocks:
    """The locations in blocks: their features without graph, held or recomputed."""

    def __init__(self, route: Route, Z: torch.Tensor, plan: StepPlan) -> None:
        self.route, self.Z, self.width = route, Z, plan.width
        self.slices = [
            slice(s, min(s + plan.block, len(Z))) for s in range(0, len(Z), plan.block)
        ]
        self.held: list[Pieces] | None = None
        if plan.hold:
            self.held = [self._compute(s) for s in self.slices]

    def _compute(self, where: slice) -> Pieces:
        with torch.no_grad():
            return self.route.pieces(self.Z[where], graph=False)

    def __len__(self) -> int:
        """Number of blocks."""
        return len(self.slices)

    def get(self, j: int) -> Pieces:
        """Block ``j``'s features."""
        return self.held[j] if self.held is not None else self._compute(self.slices[j])


def _columns(pieces: Sequence[Pieces], width: int | None) -> Iterator[Pieces]:
    """The minibatch's pieces in column blocks of ``width`` inputs, in order.

    Each chunk is computed once (where recomputed), then sliced (views).

    Yields
    ------
    NTKFeatures, JacobianFactors or torch.Tensor
        ``width`` inputs' pieces (fewer at a chunk's end); a chunk whole when
        ``width`` is ``None`` or at least its size.
    """
    for p in pieces:
        n = _inputs(p)
        if width is None or width >= n:
            yield p
            continue
        for start in range(0, n, width):
            yield p[start : start + width]


def _rows(where: slice, C: int) -> slice:
    return slice(where.start * C, where.stop * C)


def _grams(
    blocks: _Blocks, pieces: Sequence[Pieces], C: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``K_ZZ`` ``(MC, MC)`` and ``K_ZX`` ``(MC, bC)`` without a graph, by blocks."""
    route, n = blocks.route, len(blocks.Z) * C
    K_zz: torch.Tensor | None = None
    rows = []
    held = blocks.held is not None
    with torch.no_grad():
        for i, si in enumerate(blocks.slices):
            Fi = blocks.get(i)
            for j in range(i + 1):
                sj = blocks.slices[j]
                block = (
                    route.self_gram(Fi) if i == j else route.cross(Fi, blocks.get(j))
                )
                if K_zz is None:
                    K_zz = block.new_zeros(n, n)
                K_zz[_rows(si, C), _rows(sj, C)] = block
                if i != j:
                    K_zz[_rows(sj, C), _rows(si, C)] = block.mT
            if not held:  # each block's features once, every chunk for each
                crosses = [route.cross(Fi, p) for p in _columns(pieces, blocks.width)]
                rows.append(torch.cat(crosses, dim=1))
        if held:  # each chunk's pieces once (computed again if not held)
            columns = [
                torch.cat([route.cross(blocks.get(i), p) for i in range(len(blocks))])
                for p in _columns(pieces, blocks.width)
            ]
            rows = [torch.cat(columns, dim=1)]
    assert K_zz is not None
    return K_zz, torch.cat(rows)


def budgeted_gap(
    route: Route,
    plan: StepPlan,
    Z: torch.Tensor,
    pieces: Sequence[Pieces],
    hessians: torch.Tensor,
    trace_nn: torch.Tensor,
    jitter: float,
    grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The minibatch's Nyström gap and its gradient in ``Z``, by blocks of locations.

    Parameters
    ----------
    route : FactorRoute or JacobianRoute
        How pieces are computed and contracted.
    plan : StepPlan
        From :func:`plan_step`.
    Z : torch.Tensor
        ``(M, *input_shape)`` the locations.
    pieces : sequence of pieces
        The minibatch's pieces, in consecutive chunks (without graph): a list
        (held), or :class:`._batch_pieces.RecomputedPieces` (computed at each use).
    hessians : torch.Tensor
        ``Λₙ`` ``(b, C, C)``.
    trace_nn : torch.Tensor
        ``tr(Λₙ k(xₙ, xₙ))`` ``(b,)``.
    jitter : float
        Relative jitter of ``K_ZZ``.
    grad : bool, default=True
        Also compute the gradient in ``Z``.

    Returns
    -------
    loss : torch.Tensor
        Scalar, float64, without graph.
    grad : torch.Tensor or None
        ``∂loss/∂Z``, like ``Z``.

    """
    Zd = Z.detach()
    C = int(hessians.shape[-1])
    blocks = _Blocks(route, Zd, plan)
    K_zz, K_zx = _grams(blocks, pieces, C)
    lam = hessians.to(_F64)
    if not grad:
        return trace_nn.sum() - explained_trace(K_zz, K_zx, lam, jitter), None
    K_zz.requires_grad_()
    K_zx.requires_grad_()
    with torch.enable_grad():
        loss = trace_nn.sum() - explained_trace(K_zz, K_zx, lam, jitter)
        G_zz, G_zx = torch.autograd.grad(loss, [K_zz, K_zx])
    del K_zz, K_zx
    weights_zz = G_zz + G_zz.mT
    del G_zz
    gradient = torch.zeros_like(Zd)
    for i, si in enumerate(blocks.slices):
        gradient[si] = _block_gradient(
            blocks, i, weights_zz[_rows(si, C)], G_zx[_rows(si, C)], pieces, C
        )
    return loss.detach(), gradient


def _block_gradient(
    blocks: _Blocks,
    i: int,
    weights_zz: torch.Tensor,
    weights_zx: torch.Tensor,
    pieces: Sequence[Pieces],
    C: int,
) -> torch.Tensor:
    """``∂⟨W, K(Z_i, ·)⟩/∂Z_i`` for block ``i``: its features recomputed with graph."""
    route = blocks.route
    zi = blocks.Z[blocks.slices[i]].detach().requires_grad_()
    with torch.enable_grad():
        features = route.pieces(zi, graph=True)
    tensors = piece_tensors(features)
    # Only the pieces whose graph leads back to the locations get a gradient (the
    # signals of a piecewise-linear network hang on the weights alone); float64
    # leaves: the sends' gradients are summed in float64, as contracted.
    wanted = [
        t.requires_grad and reaches
        for t, reaches in zip(tensors, reaches_leaf(tensors, zi))
    ]
    leaves = [t.detach().to(_F64).requires_grad_(w) for t, w in zip(tensors, wanted)]
    leafy = with_piece_tensors(features, leaves)
    targets = [leaf for leaf in leaves if leaf.requires_grad]
    sums: list[torch.Tensor | None] = [None] * len(targets)

    def send(weight: torch.Tensor, other: Pieces) -> None:
        with torch.enable_grad():
            block = route.cross(leafy, other)
            scalar = (weight * block).sum()
        if not scalar.requires_grad:
            return
        got = torch.autograd.grad(scalar, targets, allow_unused=True)
        for k, g in enumerate(got):
            if g is not None:
                held = sums[k]
                sums[k] = g if held is None else held + g

    for j, sj in enumerate(blocks.slices):
        send(weights_zz[:, _rows(sj, C)], blocks.get(j))
    start = 0
    for p in _columns(pieces, blocks.width):
        width = _inputs(p) * C
        send(weights_zx[:, start : start + width], p)
        start += width
    outs = [
        (t, g)
        for t, g in zip([t for t, w in zip(tensors, wanted) if w], sums)
        if g is not None
    ]
    if not outs:
        return torch.zeros_like(zi)
    (g,) = torch.autograd.grad(
        [t for t, _ in outs], zi, [g.to(t.dtype) for t, g in outs], allow_unused=True
    )
    return torch.zeros_like(zi) if g is None else g


def _inputs(p: Pieces) -> int:
    """Number of inputs of pieces."""
    if isinstance(p, torch.Tensor):
        return int(p.shape[0])
    if isinstance(p, JacobianFactors):
        return p.batch
    return len(p)
