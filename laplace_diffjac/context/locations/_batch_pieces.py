"""A minibatch's kernel pieces in chunks: held, or computed again at each use.

A location step contracts the minibatch's pieces with the locations' in every
block of its plan (:mod:`._budgeted_step`). Held, they take ``b`` inputs'
features for the whole step; when that does not fit the memory budget, only the
chunks' inputs are kept and each use computes the chunk's pieces again (without
graph), so that one chunk's pieces live at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ._routes import Pieces, Route

__all__ = ["RecomputedPieces"]


class RecomputedPieces(Sequence[Pieces]):
    """The pieces of consecutive chunks of inputs, computed at each access.

    Parameters
    ----------
    route : FactorRoute or JacobianRoute
        How pieces are computed.
    chunks : sequence of torch.Tensor
        The inputs of each chunk, ``(b_k, *input_shape)`` on the model's device.

    """

    def __init__(self, route: Route, chunks: Sequence[torch.Tensor]) -> None:
        self.route = route
        self.chunks = list(chunks)

    def __len__(self) -> int:
        """Number of chunks."""
        return len(self.chunks)

    def __getitem__(self, k: int) -> Pieces:  # type: ignore[override]
        """Chunk ``k``'s pieces, computed now without graph."""
        with torch.no_grad():
            return self.route.pieces(self.chunks[k], graph=False)

    def __iter__(self) -> Iterator[Pieces]:
        """Every chunk's pieces in order, one computed at a time."""
        for k in range(len(self.chunks)):
            yield self[k]
