"""What the objective needs of the training inputs, computed once per run.

``Λₙ`` and ``tr(Λₙ k(xₙ, xₙ))`` do not depend on the locations and are always
kept (``N (C² + 1)`` numbers); the training side's kernel pieces (per-layer
features or Jacobians) are kept when they fit in a quarter of the memory budget
(:mod:`laplace_diffjac.budget`), so that a step costs the same for any ``N``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...jacobians._engine import JacobianFactors
from ...kernels import output_hessians
from ._batch_pieces import RecomputedPieces
from ._budgeted_step import feature_chunk, route_sizes
from ._gap import pieces_trace
from ._routes import Pieces, Route

__all__ = ["TrainingCache", "training_hessians"]

_F64 = torch.float64


def training_hessians(
    model: nn.Module,
    X: torch.Tensor,
    likelihood: str,
    sigma_noise: float | torch.Tensor,
    temperature: float,
    chunk_size: int,
) -> torch.Tensor:
    """``Λₙ`` of all inputs ``(N, C, C)`` (float64) from the MAP outputs.

    Parameters
    ----------
    model : torch.nn.Module
        The network, on its device.
    X : torch.Tensor
        ``(N, *input_shape)`` in the model's dtype (any device).
    likelihood : {'regression', 'classification'}
        The likelihood.
    sigma_noise : float or torch.Tensor
        Observation noise (regression).
    temperature : float
        Likelihood temperature.
    chunk_size : int
        Inputs per forward pass.

    Returns
    -------
    torch.Tensor
        ``(N, C, C)``, float64, on the model's device.

    """
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for xc in torch.split(X, chunk_size):
            f = model(xc.to(device))
            lam = output_hessians(f, likelihood, sigma_noise, temperature)
            out.append(lam.to(torch.float64))
    return torch.cat(out)


class TrainingCache:
    """The training side of the objective; ``batch(idx)`` serves a minibatch.

    Parameters
    ----------
    route : FactorRoute or JacobianRoute
        How kernel pieces are computed.
    X : torch.Tensor
        Training inputs ``(N, *input_shape)`` in the model's dtype.
    hessians : torch.Tensor
        ``Λₙ`` ``(N, C, C)`` float64 (:func:`training_hessians`).
    keep : bool, optional
        Keep the pieces of all ``N`` inputs; ``None``: if they take at most a
        quarter of ``budget`` (estimated from the first chunk).
    chunk_size : int
        Inputs whose pieces are computed at once, at most (fewer where a
        quarter of ``budget`` holds fewer while they are computed).
    budget : int
        The memory budget in bytes (:func:`laplace_diffjac.budget.get_memory_budget`).

    """

    def __init__(
        self,
        route: Route,
        X: torch.Tensor,
        hessians: torch.Tensor,
        keep: bool | None,
        chunk_size: int,
        budget: int,
    ) -> None:
        self.route, self.X, self.hessians = route, X, hessians
        if len(X):
            sizes = route_sizes(route, X[:2].to(hessians.device))
            chunk_size = feature_chunk(sizes, chunk_size, budget)
        self.chunk_size = chunk_size
        limit = budget / 4
        self.device = hessians.device
        self.pieces: Pieces | None = None
        kept: list[Pieces] = []
        traces = []
        for xc, lam in zip(
            torch.split(X, self.chunk_size), torch.split(hessians, self.chunk_size)
        ):
            if xc.shape[0] == 0:
                continue
            p = route.pieces(xc.to(self.device), graph=False)
            traces.append(pieces_trace(route, p, lam))
            if keep is None:
                keep = _nbytes(p) * X.shape[0] / xc.shape[0] <= limit
            if keep:
                kept.append(p)
        self.trace_nn = (
            torch.cat(traces) if traces else hessians.new_zeros((0,), dtype=_F64)
        )
        if keep and kept:
            self.pieces = route.cat(kept)
        #: Bytes of the features kept between steps.
        self.held_bytes = 0 if self.pieces is None else _nbytes(self.pieces)

    def __len__(self) -> int:
        """Number ``N`` of training inputs."""
        return int(self.X.shape[0])

    def batch(
        self, idx: torch.Tensor | slice, hold: bool = True
    ) -> tuple[Sequence[Pieces], torch.Tensor, torch.Tensor]:
        """Pieces (in chunks), ``Λₙ`` and ``tr(Λₙ k(xₙ, xₙ))`` of a minibatch.

        Parameters
        ----------
        idx : torch.Tensor or slice
            Indices into the training inputs.
        hold : bool, default=True
            Compute the minibatch's pieces now and hold them; ``False``: each use
            computes its chunk again (:class:`RecomputedPieces`). Cached pieces
            are served either way.

        Returns
        -------
        tuple
            ``(pieces, hessians (b, C, C), trace_nn (b,))``.

        """
        if self.pieces is not None:
            return [self.pieces[idx]], self.hessians[idx], self.trace_nn[idx]
        xb = self.X[idx].to(self.device)
        inputs = torch.split(xb, self.chunk_size)
        chunks: Sequence[Pieces] = RecomputedPieces(self.route, inputs)
        if hold:
            chunks = list(chunks)
        return chunks, self.hessians[idx], self.trace_nn[idx]


def _nbytes(pieces: Pieces) -> int:
    if isinstance(pieces, torch.Tensor):
        return pieces.numel() * pieces.element_size()
    if isinstance(pieces, JacobianFactors):
        return pieces.nbytes
    tensors = [*pieces.inputs, *(g for g in pieces.signals if g is not None)]
    return sum(t.numel() * t.element_size() for t in tensors)
