"""``ContextPosterior`` within the memory budget: chunk sizes, and chunked locations.

Everything the posterior computes from the data is a sum over training points,
and everything it predicts is per test input (or per ``q``-block), so the budget
(:mod:`laplace_diffjac.budget`) is met by taking the data and the test inputs in
chunks of ``c`` inputs and the locations in blocks of ``z`` locations. What one
step holds at once is counted before any work:

* a chunk's features while they are computed (the engine's activations and
  signals): ``c t``, ``t`` as :mod:`laplace_diffjac.kernels._feature_sizes`
  estimates it;
* the locations' features: held (``2 M f``: the blocks and their concatenation,
  ``f`` the features of one input) or, when they do not fit, recomputed block by
  block for every chunk (``z (t + f)``);
* one Gram of ``z`` locations and ``c`` inputs (its working memory, counted
  from shapes: :class:`~laplace_diffjac.kernels._feature_sizes.FeatureSizes`);
* the chunk's Grams with all locations and their whitened copies,
  ``(2 G + 2) (M C) (c C)`` numbers for ``G`` prior groups.

The plan holds the locations when that leaves a data chunk whose estimated time
is at most that of recomputing them (:func:`plan_chunks`). The results are the
same sums and the same per-input predictions, in another order of addition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from ...budget import format_bytes, over_budget
from ...errors import MemoryBudgetError
from ...kernels._feature_sizes import FeatureSizes
from ._features import BatchFeatures

__all__ = [
    "ChunkedFeatures",
    "Chunks",
    "largest_fitting",
    "plan_chunks",
    "slices",
    "test_slices",
]

#: Per-chunk overhead in the plan's time model, in inputs' worth of work.
_CALL_OVERHEAD = 4

#: Writing one input's per-layer blocks for a Gram, in the plan's time model, as
#: a share of computing its features: a data chunk's blocks are written once per
#: block of locations, the locations' once per chunk.
_WRITE = 0.25


@dataclass(frozen=True)
class Chunks:
    """How a pass over data (or test inputs) is chunked.

    Attributes
    ----------
    data : int
        Inputs per chunk.
    locations : int
        Locations per Gram block.
    hold_locations : bool
        The locations' features are held; else recomputed for every chunk.
    needs : int
        Bytes the plan holds at once, as counted.
    whole : bool
        Nothing is chunked: the locations whole, each batch whole.

    """

    data: int
    locations: int
    hold_locations: bool
    needs: int
    whole: bool


def plan_chunks(
    sizes: FeatureSizes,
    n_locations: int,
    batch: int,
    n_groups: int,
    budget: int,
    hold: bool | None = None,
) -> Chunks:
    """The chunks of a pass over batches of up to ``batch`` inputs within ``budget``.

    A time model picks among the plans that fit, per input of data and in units
    of one input's features: holding the locations in blocks of ``z`` with data
    chunks of ``c`` costs ``1 + M w (1/c + 1/z) + κ/c`` (every Gram writes both
    sides' per-layer blocks, a share :data:`_WRITE` = ``w`` of the features;
    :data:`_CALL_OVERHEAD` = ``κ`` per chunk); recomputing them for every chunk
    ``1 + (M + 2 M w + 2κ) / c``. A model, not a measurement: it only orders
    plans that all fit.

    Parameters
    ----------
    sizes : FeatureSizes
        From :func:`feature_sizes`.
    n_locations : int
        ``M``.
    batch : int
        The largest batch a pass sees (chunks are no larger).
    n_groups : int
        ``G``, the prior groups whose Grams are kept per chunk.
    budget : int
        Bytes.
    hold : bool, optional
        ``True``: the locations' features are held already (as ``fit`` chose;
        they are the posterior's, not counted); ``False``: they are computed
        again for every chunk; ``None``: choose (``fit``).

    Returns
    -------
    Chunks

    Raises
    ------
    MemoryBudgetError
        If one input and one location do not fit, before any work.

    """
    needs = _Needs(sizes, n_locations, n_groups, hold is True)
    M, batch = n_locations, max(1, batch)
    whole = max(needs.held(M, batch), needs.held(M, M))
    if hold is not False and whole <= budget:
        return Chunks(batch, M, True, int(whole), True)
    options: list[tuple[float, Chunks]] = []
    if hold is not False:
        options += needs.holding(batch, budget)
    if hold is not True:
        options += needs.recomputing(batch, budget)
    if not options:
        smallest = [needs.smallest_held()] if hold is not False else []
        smallest += [needs.recomputed(1)] if hold is not True else []
        raise MemoryBudgetError(
            over_budget(
                f"ContextPosterior with {M} locations",
                int(min(smallest)),
                budget,
                f"One input's features take {format_bytes(sizes.features)} "
                f"({format_bytes(sizes.transient)} while they are computed).",
            )
        )
    return min(options, key=lambda option: option[0])[1]


class _Needs:
    """Bytes each kind of plan holds, and the plans that fit, with their costs."""

    def __init__(
        self, sizes: FeatureSizes, n_locations: int, n_groups: int, held: bool
    ) -> None:
        self.sizes, self.M, self.n_groups = sizes, n_locations, n_groups
        # Locations held already (after ``fit``) are the posterior's state.
        self.locations = 0.0 if held else 2 * n_locations * sizes.features

    def grams(self, c: int) -> float:
        """A chunk's Grams with all locations, and their whitened copies."""
        C = self.sizes.n_outputs
        return 8.0 * (2 * self.n_groups + 2) * (self.M * C) * (c * C)

    def held(self, z: int, c: int) -> float:
        """Locations held, blocks of ``z`` against chunks of ``c``."""
        chunk = c * self.sizes.transient + self.sizes.gram(z, c) + self.grams(c)
        return self.locations + chunk

    def recomputed(self, c: int) -> float:
        """Locations computed again in blocks of ``c`` for every chunk of ``c``."""
        sizes = self.sizes
        own = c * (sizes.transient + sizes.features)
        return own + c * sizes.transient + sizes.gram(c, c) + self.grams(c)

    def _fits_held(self, z: int, budget: int, c: int) -> bool:
        return self.held(z, c) <= budget

    def smallest_held(self) -> float:
        """The least a plan that holds the locations needs."""
        return max(self.held(1, 1), self.locations + self.M * self.sizes.transient)

    def holding(self, batch: int, budget: int) -> list[tuple[float, Chunks]]:
        """Plans that hold the locations, per block size that fits, with costs."""
        M = self.M
        if self.locations + M * self.sizes.transient > budget:
            return []
        options = []
        for z in _block_sizes(M):
            c = largest_fitting(partial(self._fits_held, z, budget), batch)
            if c:
                cost = 1 + M * _WRITE * (1 / c + 1 / z) + _CALL_OVERHEAD / c
                options.append((cost, Chunks(c, z, True, int(self.held(z, c)), False)))
        return options

    def recomputing(self, batch: int, budget: int) -> list[tuple[float, Chunks]]:
        """The plan that recomputes the locations, if one fits, with its cost."""
        M = self.M
        c_r = largest_fitting(lambda c: self.recomputed(c) <= budget, max(batch, M))
        if not c_r:
            return []
        c = min(c_r, batch)
        cost = 1 + (M + 2 * M * _WRITE + 2 * _CALL_OVERHEAD) / c
        return [(cost, Chunks(c, min(c_r, M), False, int(self.recomputed(c_r)), False))]


def _block_sizes(n: int) -> list[int]:
    """``n`` and its halvings down to 1: the location blocks a plan tries."""
    sizes = [n]
    while sizes[-1] > 1:
        sizes.append((sizes[-1] + 1) // 2)
    return sizes


def largest_fitting(fits: Callable[[int], bool], n: int) -> int:
    """The largest ``c`` in ``1..n`` with ``fits(c)`` (0 if none); ``fits`` monotone."""
    lo, hi = 0, max(1, n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def test_slices(
    n: int, q: int, chunk: int, grad: bool, sizes: FeatureSizes | None, budget: int
) -> list[slice]:
    """Slices of ``n`` test inputs in whole ``q``-blocks, ``chunk`` at most.

    Returns
    -------
    list of slice

    Raises
    ------
    MemoryBudgetError
        With ``grad`` (``enable_backprop``), when the inputs' graph does not fit
        whole: every chunk's graph would be kept for the gradient.
    """
    if chunk >= n:
        return [slice(0, n)]
    if grad:
        assert sizes is not None
        raise MemoryBudgetError(
            over_budget(
                f"A prediction at {n} inputs with enable_backprop=True",
                int(n * sizes.transient),
                budget,
                f"Its graph is kept whole for the gradient; {chunk} inputs fit. "
                "Predict in smaller batches, or under torch.no_grad().",
            )
        )
    return slices(n, max(q, chunk // q * q))


def slices(n: int, chunk: int) -> list[slice]:
    """Consecutive slices of at most ``chunk`` covering ``range(n)``."""
    return [slice(s, min(s + chunk, n)) for s in range(0, n, max(1, chunk))]


class ChunkedFeatures(BatchFeatures):
    """Features of many inputs, held or computed block by block when asked.

    Every product is computed one block of inputs at a time and joined, so at most
    one block's features (besides the held ones) exist at once.

    Parameters
    ----------
    compute : callable
        ``slice ->`` the features of those inputs (detached, float64).
    n_inputs : int
        Number of inputs.
    block : int
        Inputs per block.
    hold : bool
        Compute every block once now and keep them; else compute them per use.
    outputs : torch.Tensor, optional
        ``(n_inputs, C)`` the network's outputs, if known; else they are
        collected from one pass over the blocks.

    """

    def __init__(
        self,
        compute: Callable[[slice], BatchFeatures],
        n_inputs: int,
        block: int,
        hold: bool,
        outputs: torch.Tensor | None = None,
    ) -> None:
        self._compute = compute
        self._slices = slices(n_inputs, block)
        self._block = block
        self._held: list[BatchFeatures] | None = None
        if hold:
            self._held = [compute(s) for s in self._slices]
            first = self._held[0]
            if outputs is None:
                outputs = torch.cat([b.f for b in self._held])
        else:
            first = compute(self._slices[0])
            if outputs is None:
                rest = [compute(s).f for s in self._slices[1:]]
                outputs = torch.cat([first.f, *rest])
        self._kind: type[BatchFeatures] = first.kind
        self.f = outputs

    @property
    def kind(self) -> type[BatchFeatures]:
        """The kind of the blocks' features."""
        return self._kind

    @property
    def held(self) -> bool:
        """Whether the blocks are held (else computed at every use)."""
        return self._held is not None

    def blocks(self) -> Iterator[BatchFeatures]:
        """Each block's features, held or computed now, in input order.

        Yields
        ------
        BatchFeatures
        """
        if self._held is not None:
            yield from self._held
            return
        for s in self._slices:
            yield self._compute(s)

    def gram(
        self,
        other: BatchFeatures,
        prior_var: torch.Tensor,
        columns: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """See :meth:`BatchFeatures.gram`."""
        rows = []
        for block in self.blocks():
            if isinstance(other, ChunkedFeatures):
                parts = [block.gram(o, prior_var, columns) for o in other.blocks()]
                rows.append(torch.cat(parts, dim=1))
            else:
                rows.append(block.gram(other, prior_var, columns))
        return torch.cat(rows)

    def self_blocks(self, prior_var: torch.Tensor) -> torch.Tensor:
        """See :meth:`BatchFeatures.self_blocks`."""
        return torch.cat([b.self_blocks(prior_var) for b in self.blocks()])

    def _joint_blocks(self, prior_var: torch.Tensor, q: int) -> torch.Tensor:
        return torch.cat([b.joint_blocks(prior_var, q) for b in self.blocks()])

    def jvp(self, vector: torch.Tensor) -> torch.Tensor:
        """See :meth:`BatchFeatures.jvp`."""
        return torch.cat([b.jvp(vector) for b in self.blocks()])

    def ggn_diagonal(self, lam: torch.Tensor) -> torch.Tensor:
        """See :meth:`BatchFeatures.ggn_diagonal`."""
        total = None
        for s, b in zip(self._slices, self.blocks()):
            part = b.ggn_diagonal(lam[s])
            total = part if total is None else total + part
        assert total is not None
        return total

    def detach(self) -> ChunkedFeatures:
        """See :meth:`BatchFeatures.detach` (the blocks are computed detached)."""
        return self

    def as_jacobians(self) -> ChunkedFeatures:
        """The same inputs' features as Jacobians ``J``, block by block.

        Returns
        -------
        ChunkedFeatures
        """
        compute = self._compute

        def jacobians(s: slice) -> BatchFeatures:
            return compute(s).as_jacobians()

        n = self._slices[-1].stop if self._slices else 0
        return ChunkedFeatures(
            jacobians, n, self._block, self._held is not None, self.f
        )
