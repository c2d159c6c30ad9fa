"""``J(x1) Σ₀ J(x2)ᵀ`` from the engine's per-layer factors, never all of ``J``.

The Jacobian engine (:func:`laplace_diffjac.jacobians._engine.jacobian_factors`)
gives, for every parameter, factors of its Jacobian block (:mod:`._assembly`):

``Product``  ``J[b, v, o, k] = Σ_l g[b, v, o, l] a[b, l, k]`` (Linear over ``L``
             tokens, Conv over ``L`` positions, attention projections, RNN weights)
``Summed``   ``J[b, v, o] = Σ_l g[v, b, o, l]`` (biases)
``Scattered`` ``J[b, v, s, k] = Σ_l [index[b, l] = s] g[v, b, l, k]`` (Embedding)
``Dense``    a materialised block (norm scales, PReLU, BackPACK's ``param_mjp``)

For each parameter, the Gram of its block is computed by the cheaper of two
routes, counted in multiply-adds (as neural-tangents' structured derivatives
choose, Novak et al. 2022, "Fast finite width neural tangent kernel"):

* the **factor route** contracts the factors of both batches directly, e.g. for a
  Product ``Σ_{l,m} (a1_l·a2_m) (g1_l g2_mᵀ)``, which for a Linear layer without
  tokens costs ``B1 B2 (K + V² O)`` instead of ``B1 B2 V² O K``;
* the **block route** writes that one parameter's block ``(B, V, n)`` for each
  batch and contracts it: cheaper for convolutions with many positions.

Only one parameter's block lives at a time, never the ``(B, V, P)`` Jacobian.
Everything is ordinary autograd on the factors, so the Gram is differentiable
with respect to both inputs and the parameters whenever the factors are.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..jacobians._assembly import Factors, Product, Scattered, Summed, assemble
from ..jacobians._engine import JacobianFactors

#: A factor route may hold at most this many times the block route's elements.
_MEMORY_RATIO = 4


def factor_gram(
    left: JacobianFactors,
    right: JacobianFactors | None,
    params: Sequence[torch.Tensor],
    prior_var: torch.Tensor,
) -> torch.Tensor:
    """Prior-scaled Gram of two batches' Jacobians from their factors.

    Parameters
    ----------
    left : JacobianFactors
        Factors of batch 1, ``B1`` samples, ``V`` rows.
    right : JacobianFactors or None
        Factors of batch 2 (``B2`` samples, ``V`` rows); ``None`` gives the
        per-sample diagonal blocks of ``left`` with itself.
    params : sequence of torch.Tensor
        The parameters in the Jacobians' column order.
    prior_var : torch.Tensor
        ``()`` or ``(P,)`` prior variance, in that column order.

    Returns
    -------
    torch.Tensor
        ``(B1, B2, V, V)`` with entry ``[a, b, c, e] = J_c(x1_a) Σ₀ J_e(x2_b)ᵀ``, or
        ``(B1, V, V)`` for ``right=None``.

    """
    diagonal = right is None
    other = left if right is None else right
    shape: tuple[int, ...] = (left.batch, left.n_rows, left.n_rows)
    if not diagonal:
        shape = (left.batch, other.batch, left.n_rows, other.n_rows)
    dtype = torch.promote_types(left.f.dtype, prior_var.dtype)
    # Gram-sized sums, added in place (every fresh Gram-sized tensor is a pass
    # over memory, and on CPU a page-faulting one): the blocks that carry their
    # prior, and per constant prior (by identity: one for a scalar prior) the
    # unscaled blocks it multiplies once at the end.
    scaled: _Sum = _Sum(dtype)
    unscaled: dict[int, tuple[torch.Tensor, _Sum]] = {}
    signal_grams: dict[tuple, torch.Tensor] = {}  # shared by a weight and its bias
    for route in _routes(left, other, params, prior_var, diagonal, right is left):
        if route.scale is None:
            scaled.add(_block_gram(left, other, route.param, route.var, diagonal))
            continue
        _, acc = unscaled.setdefault(id(route.scale), (route.scale, _Sum(dtype)))
        if not route.factor:
            acc.add(_block_gram(left, other, route.param, None, diagonal))
            continue
        for e1, e2 in route.entry_pairs():
            gram, shared = _pair_gram(e1, e2, diagonal, e1 is e2, signal_grams)
            acc.add(gram, writable=not shared)
    for scale, acc in unscaled.values():
        scaled.add(scale * acc.value(shape, left.f.device))
    return scaled.value(shape, left.f.device)


class _Sum:
    """A running sum of Gram-sized tensors, added in place where that is safe.

    A tensor that is not a view is the result of one of this module's
    contractions, concatenations or products, which no backward function
    saves: the sum adds into the first such tensor. A view (``einsum``'s
    permuted results) is not written into, since autograd would copy its base;
    adding two views makes a new tensor, which later terms are added into. An
    addition's backward needs neither operand.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.total: torch.Tensor | None = None
        self.owned = False  # ``total`` may be written in place

    def add(self, term: torch.Tensor, writable: bool = True) -> None:
        """Add ``term``; ``writable=False``: it is used elsewhere, never written."""
        converted = term.to(self.dtype)
        writable = (writable or converted is not term) and converted._base is None
        term = converted
        if self.total is None:
            self.total, self.owned = term, writable
        elif self.owned:
            self.total = self.total.add_(term)
        elif writable:
            self.total, self.owned = term.add_(self.total), True
        else:
            self.total, self.owned = self.total + term, True

    def value(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The sum (zeros of ``shape`` if nothing was added)."""
        if self.total is None:
            return torch.zeros(shape, dtype=self.dtype, device=device)
        return self.total


def gram_multiply_adds(
    left: JacobianFactors,
    right: JacobianFactors | None,
    params: Sequence[torch.Tensor],
    prior_var: torch.Tensor,
) -> int:
    """Multiply-adds of :func:`factor_gram`'s contractions, as its choice counts them.

    Per parameter, the count of the route :func:`factor_gram` takes with the same
    arguments: the factor route's contractions, or writing the parameter's block
    for each batch (once for a symmetric Gram, ``right is left``, as it is done)
    and contracting the blocks. The cost model that makes the choice, not a
    measurement: every written entry of a block counts as one multiply-add;
    elementwise products of the factor route, sums and the prior's scaling are not
    counted, nor the engine's passes that give the factors.

    Parameters
    ----------
    left, right, params, prior_var
        As for :func:`factor_gram`.

    Returns
    -------
    int
        Multiply-adds (one multiply-add is two floating-point operations).

    """
    diagonal = right is None
    other = left if right is None else right
    total = 0
    for route in _routes(left, other, params, prior_var, diagonal, right is left):
        if not route.factor:
            total += route.costs.block
            continue
        assert route.costs.factor is not None  # a factor route has a cost
        total += route.costs.factor
        for (e1, e2), reused in zip(route.entry_pairs(), route.reused):
            if reused:
                total -= _signals_cost(e1, e2, diagonal)
    return total


def gram_working_bytes(
    left: JacobianFactors,
    right: JacobianFactors | None,
    params: Sequence[torch.Tensor],
    prior_var: torch.Tensor,
) -> int:
    """Bytes :func:`factor_gram` holds at once beyond its operands, without a graph.

    Counted from shapes alone, per parameter for the route :func:`factor_gram`
    takes with the same arguments, so it may be asked of factors whose tensors
    are expanded views (``JacobianFactors.expanded``): the block route holds both
    batches' blocks (and the prior-scaled copy of the first), as much again for
    the copies ``einsum`` makes of them, and their Gram; the factor route, per
    pair of entries, the inputs' inner products over positions and a copy of
    them, two copies of the chunk of :func:`_chunked_product_gram`'s
    intermediate, and the pair's Gram. Two Gram-sized running sums are held
    throughout. The largest parameter's count is returned.

    Parameters
    ----------
    left, right, params, prior_var
        As for :func:`factor_gram`.

    Returns
    -------
    int
        Bytes, in the Gram's dtype.

    """
    diagonal = right is None
    other = left if right is None else right
    dtype = torch.promote_types(left.f.dtype, prior_var.dtype)
    pairs = left.batch if diagonal else left.batch * other.batch
    gram = pairs * left.n_rows * other.n_rows
    largest = 0
    for route in _routes(left, other, params, prior_var, diagonal, right is left):
        if not route.factor:
            size = route.param.numel()
            once = diagonal or right is left
            scaled = route.scale is None  # the prior-scaled copy of the first block
            blocks = left.batch * left.n_rows * size * (2 if scaled else 1)
            if not once:
                blocks += other.batch * other.n_rows * size
            largest = max(largest, 2 * blocks + gram)  # einsum's operand copies
            continue
        for e1, e2 in route.entry_pairs():
            largest = max(largest, _pair_elements(e1, e2, diagonal) + gram)
    return (largest + 2 * gram) * dtype.itemsize


def _pair_elements(e1: Factors, e2: Factors, diagonal: bool) -> int:
    """Elements :func:`_pair_gram` holds at once for one pair, besides its Gram."""
    n_rows1, batch1 = _rows_and_batch(e1)
    n_rows2, batch2 = _rows_and_batch(e2)
    pairs = batch1 if diagonal else batch1 * batch2
    if isinstance(e1, Product) and isinstance(e2, Product):
        len1, len2 = e1.g.shape[3], e2.g.shape[3]
        if len1 == 1 and len2 == 1:
            return pairs * n_rows1 * n_rows2 + pairs
        n_out = e1.g.shape[2]
        per_row = len1 * n_rows2 * n_out
        if diagonal:
            return pairs * len1 * len2 + 2 * batch1 * per_row
        chunk = min(batch2, max(1, _CHUNK_ELEMENTS // max(batch1 * per_row, 1)))
        return 2 * pairs * len1 * len2 + 2 * batch1 * chunk * per_row
    if isinstance(e1, Summed):
        return (batch1 + batch2) * n_rows1 * e1.g.shape[2]
    if isinstance(e1, Scattered) and isinstance(e2, Scattered):
        len1, len2, width = e1.g.shape[2], e2.g.shape[2], e1.g.shape[3]
        return pairs * len1 * len2 + pairs * len1 * n_rows2 * width
    return 0


def jacobian_gram_multiply_adds(
    left: JacobianFactors,
    right: JacobianFactors | None,
    params: Sequence[torch.Tensor],
) -> int:
    """Multiply-adds of writing ``J`` from the factors and contracting ``J Σ₀ Jᵀ``.

    What forming the Jacobians costs next to :func:`gram_multiply_adds`, in the
    same cost model: writing every parameter's block of ``J`` for each batch (once
    when ``right`` is ``left`` or ``None``), then ``B1 B2 V² P`` for the Gram
    (``B V² P`` for the diagonal blocks, ``right=None``).

    Parameters
    ----------
    left : JacobianFactors
        Factors of batch 1.
    right : JacobianFactors or None
        Factors of batch 2; ``None`` for the per-sample diagonal blocks.
    params : sequence of torch.Tensor
        The parameters in the Jacobians' column order.

    Returns
    -------
    int
        Multiply-adds.

    """
    batches = [left] if right is None or right is left else [left, right]
    written = sum(
        _write_cost(e, p.numel())
        for factors in batches
        for p in params
        for e in factors.factors.get(id(p), [])
    )
    n_params = sum(p.numel() for p in params)
    pairs = left.batch if right is None else left.batch * right.batch
    n_rows2 = left.n_rows if right is None else right.n_rows
    return written + pairs * left.n_rows * n_rows2 * n_params


@dataclass(frozen=True)
class _Route:
    """How one parameter's Gram is computed: the plan both counts and runs.

    ``var``: the parameter's prior variance, ``()`` or ``(p.numel(),)``;
    ``scale``: that variance as a scalar where it is constant (else ``None``:
    the block route, scaled); ``factor``: the factor route (else the block
    route); ``reused``: per pair of entries (``entry_pairs``' order), whether
    its signal Gram was computed for an earlier parameter (a Linear bias after
    its weight) and is shared.
    """

    param: torch.Tensor
    var: torch.Tensor
    scale: torch.Tensor | None
    entries1: list[Factors]
    entries2: list[Factors]
    costs: _RouteCosts
    factor: bool
    reused: tuple[bool, ...]

    def entry_pairs(self) -> Iterator[tuple[Factors, Factors]]:
        """Every pair of the parameter's entries in the two batches.

        Yields
        ------
        tuple of Factors
            An entry of batch 1 and one of batch 2.
        """
        for e1 in self.entries1:
            for e2 in self.entries2:
                yield e1, e2


def _routes(
    left: JacobianFactors,
    right: JacobianFactors,
    params: Sequence[torch.Tensor],
    prior_var: torch.Tensor,
    diagonal: bool,
    symmetric: bool,
) -> Iterator[_Route]:
    """Each parameter's route, chosen by its cost model, in column order.

    The factor route needs a constant prior; it is taken where it is cheaper
    (:attr:`_RouteCosts.factor_chosen`) or where every pair's signal Gram was
    computed before (it then costs next to nothing). A prior that varies across
    a parameter's entries takes the block route, scaled.

    Yields
    ------
    _Route
        Per parameter with Jacobian columns in both batches.
    """
    computed: set[tuple] = set()  # signal Grams' keys, in the order they are made
    for p, var, entries1, entries2 in _pairs(left, right, params, prior_var):
        costs = _route_costs(entries1, entries2, diagonal, symmetric, p.numel())
        scale = _constant(var)
        factor = scale is not None and (
            costs.factor_chosen or _all_shared(entries1, entries2, computed)
        )
        reused = []
        if factor:
            for e1 in entries1:
                for e2 in entries2:
                    key = _signals_key(e1, e2)
                    reused.append(key in computed)
                    if key is not None:
                        computed.add(key)
        yield _Route(p, var, scale, entries1, entries2, costs, factor, tuple(reused))


def _pairs(
    left: JacobianFactors,
    right: JacobianFactors,
    params: Sequence[torch.Tensor],
    prior_var: torch.Tensor,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[Factors], list[Factors]]]:
    """Each parameter with Jacobian columns in both batches: its prior and entries."""
    start = 0
    for p in params:
        size = p.numel()
        var = prior_var if prior_var.dim() == 0 else prior_var[start : start + size]
        start += size
        entries1 = left.factors.get(id(p), [])
        entries2 = right.factors.get(id(p), [])
        if entries1 and entries2:
            yield p, var, entries1, entries2


def _constant(var: torch.Tensor) -> torch.Tensor | None:
    """``var`` as a scalar if it is one (or is constant and needs no gradient)."""
    if var.dim() == 0:
        return var
    if var.requires_grad or not bool((var == var[0]).all()):
        return None
    return var[0]


def _block_gram(
    left: JacobianFactors,
    right: JacobianFactors,
    p: torch.Tensor,
    var: torch.Tensor | None,
    diagonal: bool,
) -> torch.Tensor:
    """The block route: write ``p``'s block for both batches and contract.

    ``var``: ``p``'s prior variance, ``(p.numel(),)`` or ``()``; ``None``: unscaled.

    Returns
    -------
    torch.Tensor
        ``(B1, B2, V, V)``, or ``(B1, V, V)`` on the diagonal.
    """
    J1 = assemble(left.factors, [p], left.n_rows, left.batch, left.f)
    J1v = J1 if var is None else J1 * var
    if diagonal:
        return torch.einsum("bvn,bwn->bvw", J1v, J1)
    same = right is left  # a symmetric Gram: the block is written once
    J2 = (
        J1 if same else assemble(right.factors, [p], right.n_rows, right.batch, right.f)
    )
    return torch.einsum("bvn,cwn->bcvw", J1v, J2)


@dataclass(frozen=True)
class _RouteCosts:
    """One parameter's two routes in multiply-adds, and their largest intermediates.

    ``factor`` is ``None`` where some pair of entries has no factor route.
    """

    factor: int | None
    factor_memory: int
    block: int
    block_memory: int

    @property
    def factor_chosen(self) -> bool:
        """A factor route, cheaper, holding at most ``_MEMORY_RATIO`` × the block's."""
        if self.factor is None:
            return False
        if self.factor_memory > _MEMORY_RATIO * self.block_memory:
            return False
        return self.factor < self.block


def _route_costs(
    entries1: list[Factors],
    entries2: list[Factors],
    diagonal: bool,
    symmetric: bool,
    size: int,
) -> _RouteCosts:
    """Both routes' multiply-adds and largest intermediates for one parameter.

    ``size`` is the parameter's number of entries, the width of its block;
    ``symmetric``: the Gram of a batch with itself, whose block
    :func:`_block_gram` writes once.

    Returns
    -------
    _RouteCosts
        The factor route's cost summed over all pairs of entries (``None`` if a
        pair has none), and the block route's: writing the block for each batch
        and contracting.

    """
    costs = [
        _pair_cost(e1, e2, diagonal, symmetric and e1 is e2)
        for e1 in entries1
        for e2 in entries2
    ]
    known = [cost for cost in costs if cost is not None]
    factor = sum(cost[0] for cost in known) if len(known) == len(costs) else None
    factor_memory = max((cost[1] for cost in known), default=0)
    n_rows1, batch1 = _rows_and_batch(entries1[0])
    n_rows2, batch2 = _rows_and_batch(entries2[0])
    pairs = batch1 if diagonal else batch1 * batch2
    once = diagonal or symmetric
    written = entries1 if once else entries1 + entries2
    block_cost = sum(_write_cost(e, size) for e in written)
    block_cost += pairs * n_rows1 * n_rows2 * size
    block_memory = (batch1 * n_rows1 + (0 if once else batch2 * n_rows2)) * size
    return _RouteCosts(factor, factor_memory, block_cost, block_memory)


def _rows_and_batch(e: Factors) -> tuple[int, int]:
    """Rows ``V`` and samples ``B`` of the block that ``e`` writes."""
    if isinstance(e, Product):
        return e.g.shape[1], e.g.shape[0]
    if isinstance(e, (Summed, Scattered)):
        return e.g.shape[0], e.g.shape[1]
    return e.block.shape[0], e.block.shape[1]


def _write_cost(e: Factors, size: int) -> int:
    """Multiply-adds of writing ``e``'s block of ``size`` columns."""
    n_rows, batch = _rows_and_batch(e)
    positions = e.g.shape[3] if isinstance(e, Product) else 1
    return n_rows * batch * size * positions


def _pair_cost(
    e1: Factors, e2: Factors, diagonal: bool, symmetric: bool = False
) -> tuple[int, int] | None:
    """Multiply-adds and largest intermediate of the factor route, if it has one.

    ``symmetric``: ``e2`` is ``e1`` in the Gram of a batch with itself, where a
    Product over positions is computed for the pairs of the chunks on and below
    the diagonal only (:func:`_chunked_product_gram`).

    Returns
    -------
    tuple of int or None
        Multiply-adds and the largest intermediate's elements.
    """
    if type(e1) is not type(e2) or not isinstance(e1, (Product, Summed, Scattered)):
        return None
    n_rows1, batch1 = _rows_and_batch(e1)
    n_rows2, batch2 = _rows_and_batch(e2)
    pairs = batch1 if diagonal else batch1 * batch2
    rows = n_rows1 * n_rows2
    if isinstance(e1, Summed):
        return pairs * rows * e1.g.shape[2], pairs * rows
    if isinstance(e1, Product):
        assert isinstance(e2, Product)
        (_, _, n_out, len1), len2 = e1.g.shape, e2.g.shape[3]
        width = e1.a.shape[2]
        if len1 == 1 and len2 == 1:
            return pairs * (width + rows * n_out), pairs * rows
        inputs = pairs * len1 * len2 * width
        if symmetric and not diagonal:  # as _chunked_product_gram runs it
            chunks = _lower_chunks(batch1, len1 * n_rows2 * n_out)
            pairs = sum((batch1 - start) * (stop - start) for start, stop in chunks)
        mixed = pairs * len1 * len2 * n_rows2 * n_out
        return (
            inputs + mixed + pairs * len1 * rows * n_out,
            pairs * len1 * n_rows2 * n_out,
        )
    assert isinstance(e1, Scattered) and isinstance(e2, Scattered)
    len1, width, len2 = e1.g.shape[2], e1.g.shape[3], e2.g.shape[2]
    mixed = pairs * len1 * len2 * n_rows2 * width
    return mixed + pairs * len1 * rows * width, pairs * len1 * n_rows2 * width


#: Elements of the ``(B1, c, L1, V, out)`` intermediate of one chunk of batch 2
#: in :func:`_chunked_product_gram` (4 MiB in float32: it stays in cache).
_CHUNK_ELEMENTS = 2**20


def _chunked_product_gram(
    g1: torch.Tensor,
    inputs: torch.Tensor,
    g2: torch.Tensor,
    symmetric: bool = False,
) -> torch.Tensor:
    """``Σ_{l,m} (a1_l·a2_m) (g1_l g2_mᵀ)`` of two Products, batch 2 in chunks.

    The intermediate ``Σ_m (a1_l·a2_m) g2_m`` is ``(B1, B2, L1, V, out)``; built
    whole it does not fit in cache and the contractions around it, with inner
    dimensions as small as the number of positions, spend their time copying
    it (a small CNN's second convolution: 84 MB, most of its Gram's time).
    Chunks of batch 2 keep it near :data:`_CHUNK_ELEMENTS` (half the time there).
    For the Gram of a batch with itself only the blocks on and below the
    diagonal are computed (a little over half the work); the others are their
    transposes.

    Parameters
    ----------
    g1 : torch.Tensor
        ``(B1, V, out, L1)`` signals of batch 1.
    inputs : torch.Tensor
        ``(B1, B2, L1, L2)`` inputs' inner products ``a1_l·a2_m``.
    g2 : torch.Tensor
        ``(B2, V, out, L2)`` signals of batch 2.
    symmetric : bool, default=False
        Batch 2 is batch 1 (``g2`` is ``g1`` and ``inputs`` symmetric).

    Returns
    -------
    torch.Tensor
        ``(B1, B2, V, V)``.

    """
    batch1, _, n_out, positions = g1.shape
    per_row = positions * g2.shape[1] * n_out  # the intermediate's, per pair
    # Chunks are taken by ``torch.split``, whose backward writes one gradient;
    # slicing's writes a zero tensor of the whole per slice and adds them.
    if not symmetric:
        chunk = max(1, _CHUNK_ELEMENTS // max(batch1 * per_row, 1))
        if chunk >= g2.shape[0]:
            return _product_block(g1, inputs, g2)
        blocks = [
            _product_block(g1, part, g2_part)
            for part, g2_part in zip(
                inputs.split(chunk, dim=1), g2.split(chunk), strict=True
            )
        ]
        return torch.cat(blocks, dim=1)
    chunks = _lower_chunks(batch1, per_row)
    if len(chunks) == 1:
        return _product_block(g1, inputs, g2)
    sizes = [stop - start for start, stop in chunks]
    rows, columns = g1.split(sizes), inputs.split(sizes, dim=1)
    lower = []  # lower[j]: Gram[s_j:, s_j:e_j], the chunks on and below the diagonal
    for j, (start, _) in enumerate(chunks):
        g1_rows = g1 if j == 0 else torch.cat(rows[j:])
        lower.append(_product_block(g1_rows, columns[j][start:], rows[j]))
    pieces = [block.split(sizes[j:]) for j, block in enumerate(lower)]
    gram_columns = []
    for j, block in enumerate(lower):
        above = [  # Gram[chunk i, chunk j] = Gram[chunk j, chunk i]ᵀ
            pieces[i][j - i].permute(1, 0, 3, 2) for i in range(j)
        ]
        gram_columns.append(torch.cat([*above, block], dim=0))
    return torch.cat(gram_columns, dim=1)


def _product_block(
    g1: torch.Tensor, inputs: torch.Tensor, g2: torch.Tensor
) -> torch.Tensor:
    """``(B1, B2, V, W)``: ``Σ_{l,m} inputs[b, c, l, m] (g1_l g2_mᵀ)``, unchunked.

    Two batched products with the layouts chosen here, not by ``einsum``: the
    intermediate ``(B2, B1 L1, W out)`` is copied once, to ``(B1, B2 W, L1 out)``,
    whose rows are runs of ``out`` contiguous numbers (``einsum``'s layout gathers
    every ``out``-th number, about a fifth slower for the whole step).

    Returns
    -------
    torch.Tensor
        ``(B1, B2, V, W)``.
    """
    batch1, n_rows1, n_out, len1 = g1.shape
    batch2, n_rows2, _, len2 = g2.shape
    inputs_c = inputs.permute(1, 0, 2, 3).reshape(batch2, batch1 * len1, len2)
    signals2 = g2.reshape(batch2, n_rows2 * n_out, len2).transpose(1, 2)
    mixed = torch.bmm(inputs_c, signals2)  # (c, b l, w o)
    mixed = mixed.reshape(batch2, batch1, len1, n_rows2, n_out).permute(1, 0, 3, 2, 4)
    mixed = mixed.reshape(batch1, batch2 * n_rows2, len1 * n_out)  # (b, c w, l o)
    signals1 = g1.permute(0, 3, 2, 1).reshape(batch1, len1 * n_out, n_rows1)
    gram = torch.bmm(mixed, signals1)  # (b, c w, v)
    return gram.reshape(batch1, batch2, n_rows2, n_rows1).transpose(2, 3)


def _lower_chunks(batch: int, per_row: int) -> list[tuple[int, int]]:
    """Column chunks ``[start, stop)`` of a symmetric Gram, rows from ``start`` on.

    Each chunk's intermediate, ``(batch − start) × (stop − start)`` pairs of
    ``per_row`` elements, stays near :data:`_CHUNK_ELEMENTS`.

    Returns
    -------
    list of tuple of int
        ``(start, stop)`` per chunk, covering ``range(batch)``.
    """
    chunks, start = [], 0
    while start < batch:
        size = max(1, _CHUNK_ELEMENTS // max((batch - start) * per_row, 1))
        chunks.append((start, min(start + size, batch)))
        start += size
    return chunks


def _view_key(t: torch.Tensor) -> tuple:
    """What makes two views the same numbers: memory, geometry, type."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _signals_key(e1: Factors, e2: Factors) -> tuple | None:
    """Identity of a pair's signal Gram ``Σ_o g1[v, b, o] g2[w, c, o]``, if one.

    Where there is one position the Gram is one contraction of views: a Linear
    weight's Product and its bias's Summed view the same signals, so their
    pairs share this Gram.

    Returns
    -------
    tuple or None
        The two views' keys; ``None`` for other entries.
    """
    if type(e1) is not type(e2):
        return None
    if not isinstance(e1, (Product, Summed)) or not isinstance(e2, (Product, Summed)):
        return None
    if e1.g.shape[3] != 1 or e2.g.shape[3] != 1:
        return None
    s1, s2 = _signals(e1), _signals(e2)
    return (_view_key(s1), _view_key(s2))


def _all_shared(
    entries1: list[Factors], entries2: list[Factors], computed: Collection[tuple]
) -> bool:
    """Whether every pair's signal Gram is among the ``computed`` ones.

    A bias after its weight: its factor route then costs next to nothing.

    Returns
    -------
    bool
    """
    keys = [_signals_key(e1, e2) for e1 in entries1 for e2 in entries2]
    return all(key is not None and key in computed for key in keys)


def _signals(e: Product | Summed) -> torch.Tensor:
    """``(V, B, out)`` signals of a one-position entry, a view."""
    g = e.g[..., 0]
    return g.transpose(0, 1) if isinstance(e, Product) else g


def _signal_gram(s1: torch.Tensor, s2: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """``Σ_o s1[v, b, o] s2[w, c, o]``: ``(B1, B2, V, W)``, or ``(B, V, W)``.

    The engine's signals are ``(V, B, out)`` and contiguous, so off the diagonal
    the Gram is one matrix product of two free ``(V B, out)`` views, the second
    read transposed by BLAS; ``einsum`` would first copy an operand into an
    ``out``-major layout (about a third of the product's time on a CPU), and so
    would autograd's two products behind it.

    Returns
    -------
    torch.Tensor
        ``(B1, B2, V, W)`` (a permuted view of the product), or ``(B, V, W)`` on
        the diagonal (``diagonal=True``).
    """
    if diagonal:
        return torch.einsum("vbo,wbo->bvw", s1, s2)
    v, b1, out = s1.shape
    w, b2, _ = s2.shape
    gram = s1.reshape(v * b1, out) @ s2.reshape(w * b2, out).T
    return gram.view(v, b1, w, b2).permute(1, 3, 0, 2)


def _signals_cost(e1: Factors, e2: Factors, diagonal: bool) -> int:
    """Multiply-adds of a one-position pair's signal Gram."""
    n_rows1, batch1 = _rows_and_batch(e1)
    n_rows2, batch2 = _rows_and_batch(e2)
    pairs = batch1 if diagonal else batch1 * batch2
    assert isinstance(e1, (Product, Summed))
    return pairs * n_rows1 * n_rows2 * e1.g.shape[2]


def _pair_gram(
    e1: Factors,
    e2: Factors,
    diagonal: bool,
    symmetric: bool = False,
    signal_grams: dict[tuple, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, bool]:
    """The factor route for one pair of same-kind entries (see :func:`_pair_cost`).

    ``symmetric``: ``e2`` is ``e1`` (the Gram of a batch with itself), whose
    Gram a Product over positions computes on and below the diagonal only.
    ``signal_grams``: the one-position signal Grams computed so far, by
    :func:`_signals_key`; a bias's Gram is then its weight's signal Gram itself
    (returned as it is, shared), or the other way round.

    Einsum letters: ``b``/``c`` samples of batch 1/2 (both ``b`` on the
    diagonal), ``v``/``w`` rows, ``o`` outputs, ``l``/``m`` tokens, ``k`` inputs.

    Returns
    -------
    gram : torch.Tensor
        ``(B1, B2, V, V)``, or ``(B1, V, V)`` on the diagonal; unscaled by the prior.
    shared : bool
        ``gram`` is a signal Gram kept in ``signal_grams`` for other pairs: read
        it, never write into it.

    """
    c = "b" if diagonal else "c"
    pair = "b" if diagonal else "bc"
    key = _signals_key(e1, e2)
    if key is not None:  # one position: the signals' Gram, maybe computed before
        assert isinstance(e1, (Product, Summed)) and isinstance(e2, (Product, Summed))
        cache = {} if signal_grams is None else signal_grams
        if key not in cache:
            cache[key] = _signal_gram(_signals(e1), _signals(e2), diagonal)
        signals = cache[key]
        if isinstance(e1, Summed):
            return signals, True
        assert isinstance(e2, Product)
        inputs = torch.einsum(f"bk,{c}k->{pair}", e1.a[:, 0], e2.a[:, 0])
        return inputs[..., None, None] * signals, False
    if isinstance(e1, Summed):
        assert isinstance(e2, Summed)
        s1, s2 = e1.g.sum(3), e2.g.sum(3)  # (V, B, out)
        return torch.einsum(f"vbo,w{c}o->{pair}vw", s1, s2), False
    if isinstance(e1, Product):
        assert isinstance(e2, Product)
        inputs = torch.einsum(f"blk,{c}mk->{pair}lm", e1.a, e2.a)
        if diagonal:
            mixed = torch.einsum("blm,bwom->blwo", inputs, e2.g)
            return torch.einsum("bvol,blwo->bvw", e1.g, mixed), False
        return _chunked_product_gram(e1.g, inputs, e2.g, symmetric), False
    assert isinstance(e1, Scattered) and isinstance(e2, Scattered)
    if diagonal:
        same = (e1.index[:, :, None] == e2.index[:, None, :]).to(e1.g.dtype)
    else:
        same = (e1.index[:, None, :, None] == e2.index[None, :, None, :]).to(e1.g.dtype)
    mixed = torch.einsum(f"{pair}lm,w{c}mk->{pair}lwk", same, e2.g)
    return torch.einsum(f"vblk,{pair}lwk->{pair}vw", e1.g, mixed), False
