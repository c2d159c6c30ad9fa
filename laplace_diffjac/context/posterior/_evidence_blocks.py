"""The evidence's gradient in ``Z`` when the locations' graph does not fit.

Pass 2 of :func:`~laplace_diffjac.context.evidence_loss_backward` adds
``Σ_b ⟨∂F/∂W, ∂W_b/∂Z⟩``, ``W_b = V_b Λ_b V_bᵀ``, ``V_b = L⁻¹ K_Zb``,
``L Lᵀ = K_ZZ + ε I``. Holding the locations' features with their graph through
the pass is the fast way (:mod:`._evidence_gradient`); when that does not fit the
memory budget, the Grams stand in as leaves:

1. ``K_ZZ`` without a graph, the locations in blocks of ``z`` (their features
   held without a graph when they fit, else computed again for each use), and
   its factor ``L`` with a graph back to ``K_ZZ``;
2. for each chunk of ``c`` data inputs: ``K_Zb`` without a graph, then
   ``⟨∂F/∂W, W_b⟩`` differentiated in ``K_Zb`` and (summed over chunks)
   ``K_ZZ``; each block of locations computes its features again with their
   graph and takes its rows of ``∂/∂K_Zb`` back to ``Z``;
3. each block of locations, with its graph, takes its rows of
   ``∂/∂K_ZZ + (∂/∂K_ZZ)ᵀ`` against the other blocks (without graph) back to ``Z``.

The value and the gradient are the held pass's, summed in another order; the
cost is one pass over the locations' features with their graph per data chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from ...backends import JacobianBackend
from ...budget import format_bytes, over_budget
from ...data import TrainingData
from ...errors import MemoryBudgetError
from ...kernels import output_hessians
from ...kernels._feature_sizes import FeatureSizes
from ._chunks import largest_fitting, slices
from ._features import BatchFeatures, batch_features
from ._statistics import frame_factor

__all__ = [
    "BlockedGradientPlan",
    "blocked_data_gradient",
    "plan_blocked_gradient",
    "whitened_sum",
]


@dataclass(frozen=True)
class BlockedGradientPlan:
    """Pass 2 by blocks: ``block`` locations, ``chunk`` data inputs at a time.

    Attributes
    ----------
    block : int
        Locations per block ``z``.
    chunk : int
        Data inputs per chunk ``c``.
    hold : bool
        The locations' features (without graph) are held through the pass.
    needs : int
        Bytes held at once, as counted.

    """

    block: int
    chunk: int
    hold: bool
    needs: int


def plan_blocked_gradient(
    sizes: FeatureSizes, n_locations: int, batch: int, budget: int
) -> BlockedGradientPlan:
    """The largest data chunks, then blocks of locations, that fit ``budget``.

    Counted: ``K_ZZ``, its factor and its gradient (``3 (MC)²`` float64 numbers);
    the locations' features without graph (all of them where held, else one
    block's while computed); per chunk of ``c`` inputs their features while
    computed and four ``MC × cC`` matrices (``K``, ``V``, ``VΛ`` and a
    gradient); and the larger of a block's Gram against a chunk without a graph
    and the same with the block's graph. Every chunk costs one pass over the
    locations' features with their graph whatever the blocks, so the chunks
    come first; holding the locations' features saves computing them again for
    every Gram.

    Parameters
    ----------
    sizes : FeatureSizes
        Of the backend's features.
    n_locations : int
        ``M``.
    batch : int
        The largest batch of the data.
    budget : int
        Bytes.

    Returns
    -------
    BlockedGradientPlan

    Raises
    ------
    MemoryBudgetError
        If one location and one data input do not fit, before any work.

    """
    M, C = n_locations, sizes.n_outputs
    batch = max(1, batch)
    matrices = 3 * 8.0 * (M * C) ** 2

    def needs(hold: bool, z: int, c: int) -> float:
        held = M * sizes.features if hold else z * (sizes.features + sizes.transient)
        chunk = c * sizes.transient + 32.0 * M * C * c * C
        columns = max(z, c)  # other blocks of locations, or a chunk of data
        gram = max(
            sizes.gram(z, columns), z * sizes.graph + sizes.graph_gram(z, columns)
        )
        return matrices + held + chunk + gram

    for hold in (True, False):
        c = largest_fitting(partial(_fits, needs, budget, hold, 1), batch)
        if c:
            z = largest_fitting(partial(_fits, needs, budget, hold, c=c), M)
            return BlockedGradientPlan(z, c, hold, int(needs(hold, z, c)))
    raise MemoryBudgetError(
        over_budget(
            f"objective='evidence' with {M} locations",
            int(needs(False, 1, 1)),
            budget,
            f"Its gradient keeps K_ZZ and its factor ({format_bytes(matrices)}) "
            f"and one location's features with their graph "
            f"({format_bytes(sizes.graph)}) beside one input's; fewer locations "
            "fit.",
        )
    )


def _fits(
    needs: Callable[[bool, int, int], float], budget: int, hold: bool, z: int, c: int
) -> bool:
    """Whether blocks of ``z`` locations and chunks of ``c`` inputs fit."""
    return needs(hold, z, c) <= budget


def whitened_sum(L: torch.Tensor, K: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """A chunk's whitened sum ``W_b = V Λ Vᵀ``, ``V = L⁻¹ K_Zb``.

    Parameters
    ----------
    L : torch.Tensor
        ``(MC, MC)`` lower-triangular frame factor.
    K : torch.Tensor
        ``(MC, bC)`` the locations' Gram against the chunk.
    lam : torch.Tensor
        ``(b, C, C)`` the chunk's ``Λₙ``.

    Returns
    -------
    torch.Tensor
        ``(MC, MC)``, differentiable in ``L`` and ``K``.
    """
    MC = L.shape[0]
    V = torch.linalg.solve_triangular(L, K, upper=False).reshape(MC, *lam.shape[:2])
    VL = torch.einsum("kbc,bce->kbe", V, lam).reshape(MC, -1)
    return V.reshape(MC, -1) @ VL.T


def blocked_data_gradient(
    backend: JacobianBackend,
    locations: torch.Tensor,
    grad_W: torch.Tensor,
    data: TrainingData,
    likelihood: str,
    jitter: float,
    plan: BlockedGradientPlan,
) -> None:
    """Pass 2 by blocks: add ``Σ_b ⟨∂F/∂W, ∂W_b/∂Z⟩`` to ``locations.grad``.

    Parameters
    ----------
    backend : JacobianBackend
        The backend.
    locations : torch.Tensor
        ``Z`` ``(M, *input_shape)``, a leaf that requires grad.
    grad_W : torch.Tensor
        ``∂F/∂W`` ``(MC, MC)``.
    data : TrainingData
        The data (this rank's shard), read once.
    likelihood : {'regression', 'classification'}
        Decides ``Λ``.
    jitter : float
        Relative jitter of ``K_ZZ``.
    plan : BlockedGradientPlan
        From :func:`plan_blocked_gradient`.

    """
    ones = torch.ones((), dtype=torch.float64, device=locations.device)
    blocks = _LocationBlocks(backend, locations, plan)
    C = grad_W.shape[0] // len(locations)
    K_zz = blocks.gram(ones).requires_grad_()
    with torch.enable_grad():
        L = frame_factor(K_zz, jitter)
    for xb in data.input_batches():
        xb = xb.to(locations.device)
        for where in slices(len(xb), plan.chunk):
            with torch.no_grad():
                features = batch_features(backend, xb[where], False)
                lam = output_hessians(features.f, likelihood)
            K = blocks.cross(features, ones).requires_grad_()
            with torch.enable_grad():
                W_b = whitened_sum(L, K, lam)
                (grad_W * W_b).sum().backward(retain_graph=True, inputs=[K, K_zz])
            assert K.grad is not None
            blocks.send(K.grad, [features], C, ones)
            del features, K, W_b
    assert K_zz.grad is not None
    weights = K_zz.grad + K_zz.grad.mT
    del L, K_zz
    blocks.send(weights, blocks, C, ones)


class _LocationBlocks:
    """The locations in blocks: features without graph, held or computed per use."""

    def __init__(
        self,
        backend: JacobianBackend,
        locations: torch.Tensor,
        plan: BlockedGradientPlan,
    ) -> None:
        self.backend, self.locations = backend, locations
        self.slices = slices(len(locations), plan.block)
        self.held: list[BatchFeatures] | None = None
        if plan.hold:
            self.held = [self._compute(s) for s in self.slices]

    def _compute(self, where: slice) -> BatchFeatures:
        with torch.no_grad():
            return batch_features(self.backend, self.locations.detach()[where], False)

    def get(self, i: int) -> BatchFeatures:
        """Block ``i``'s features without graph."""
        return self.held[i] if self.held is not None else self._compute(self.slices[i])

    def __iter__(self) -> Iterator[BatchFeatures]:
        """Every block's features without graph, in order (again at each pass)."""
        return (self.get(i) for i in range(len(self.slices)))

    def gram(self, ones: torch.Tensor) -> torch.Tensor:
        """``K_ZZ`` ``(MC, MC)`` without graph, block by block."""
        with torch.no_grad():
            rows = [torch.cat([Fi.gram(Fj, ones) for Fj in self], dim=1) for Fi in self]
        return torch.cat(rows)

    def cross(self, other: BatchFeatures, ones: torch.Tensor) -> torch.Tensor:
        """``K_Zb`` ``(MC, bC)`` without graph, block by block."""
        with torch.no_grad():
            return torch.cat([Fi.gram(other, ones) for Fi in self])

    def send(
        self,
        weights: torch.Tensor,
        columns: Iterable[BatchFeatures],
        C: int,
        ones: torch.Tensor,
    ) -> None:
        """Add ``∂⟨weights, K(Z, columns)⟩/∂Z`` to ``locations.grad``.

        The columns (a list, or these blocks, iterated once per block) are held
        fixed; each block's features are computed again with their graph, and
        one column block's Gram is kept at a time.
        """
        for where in self.slices:
            rows = slice(where.start * C, where.stop * C)
            with torch.enable_grad():
                Zi = batch_features(self.backend, self.locations[where], True)
                start = 0
                for other in columns:  # one column block's features at a time
                    block = Zi.gram(other, ones)
                    width = block.shape[1]
                    part = weights[rows, start : start + width]
                    start += width
                    # Zi's graph serves every column block; it goes with Zi
                    (part * block).sum().backward(
                        retain_graph=True, inputs=[self.locations]
                    )
                del Zi
