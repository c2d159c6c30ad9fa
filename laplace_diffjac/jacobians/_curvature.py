"""The GGN's diagonal and Kronecker factors, the empirical Fisher's diagonal.

One forward pass of the engine, then its batched backward seeded with square
roots of the loss Hessian (the GGN, exact or Monte Carlo) or with the loss
gradients (the empirical Fisher) instead of the outputs (:mod:`._loss_seeds`),
a chunk of those rows at a time (:func:`._engine.row_chunked_factors`): the
curvature is a sum over the rows of squares of the per-layer factors
(:mod:`._factor_products`, :mod:`._kronecker`), so each chunk's part is added and
its signals and factors freed before the next chunk goes back. Any module
structure the engine takes (classes, residual connections, shared modules, dict-
like inputs, the local rule) has its curvature so, with nothing of BackPACK's
extensions, hooks or module list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._derivatives import owning_modules
from ._engine import JacobianFactors, row_chunked_factors
from ._factor_products import factor_ggn_diagonal
from ._kronecker import KroneckerSums
from ._loss_seeds import ggn_seeds, gradient_seeds, model_loss

__all__ = ["ef_diagonal", "ggn_diagonal", "ggn_kronecker_factors"]

#: The diagonal's chunks of rows, in multiples of the engine's: its position
#: Grams (:mod:`._position_diagonal`) cost the same for one row as for many, so
#: fewer, larger chunks are faster (a CIFAR ResNet with 100 classes, batch 128,
#: one thread: 14 s with 256 MiB, 20 s with 64 MiB).
_DIAGONAL_CHUNK_SCALE = 4


def _summed_diagonal(
    model: nn.Module,
    root: nn.Module,
    x: torch.Tensor | Mapping[str, Any],
    params: Sequence[torch.Tensor],
    seeds: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model output and ``Σ_b Σ_v J_bv²`` of the seeded rows, chunk by chunk."""
    total: list[torch.Tensor] = []

    def add(parts: JacobianFactors) -> None:
        part = factor_ggn_diagonal(parts, params)
        total.append(part if not total else total.pop() + part)

    f = row_chunked_factors(
        model, x, params, seeds, add, root=root, chunk_scale=_DIAGONAL_CHUNK_SCALE
    )
    if not total:  # no rows: nothing was added
        size = sum(p.numel() for p in params)
        return f, torch.zeros(size, dtype=f.dtype, device=f.device)
    return f, total[0]


def ggn_diagonal(
    model: nn.Module,
    root: nn.Module,
    lossfunc: nn.Module,
    x: torch.Tensor | Mapping[str, Any],
    y: torch.Tensor,
    params: Sequence[torch.Tensor],
    *,
    stochastic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and ``diag(Σ_b J_bᵀ Λ_b J_b)`` of one batch.

    Parameters
    ----------
    model : torch.nn.Module
        Called as ``model(x)``, output ``(batch, C)`` or ``(batch,)``.
    root : torch.nn.Module
        Submodule owning ``params`` (the model, or its last layer).
    lossfunc : torch.nn.Module
        Sum-reduced ``CrossEntropyLoss`` or ``MSELoss``.
    x : torch.Tensor or Mapping
        Input batch, or a dict-like batch.
    y : torch.Tensor
        Targets.
    params : sequence of torch.Tensor
        Parameters, in the order of the result.
    stochastic : bool, default=False
        One Monte-Carlo sample of the Fisher per input (BackPACK's draws).

    Returns
    -------
    loss : torch.Tensor
        ``lossfunc(model(x), y)``, detached.
    diagonal : torch.Tensor
        ``(P,)``, detached.

    """
    f, diagonal = _summed_diagonal(
        model, root, x, params, lambda f: ggn_seeds(lossfunc, f, stochastic=stochastic)
    )
    return model_loss(lossfunc, _two_dim(f), y), diagonal


def ef_diagonal(
    model: nn.Module,
    root: nn.Module,
    lossfunc: nn.Module,
    x: torch.Tensor | Mapping[str, Any],
    y: torch.Tensor,
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and ``Σ_b g_b²``, the per-sample loss gradients squared and summed.

    Arguments as for :func:`ggn_diagonal`.

    Returns
    -------
    loss : torch.Tensor
        Detached.
    diagonal : torch.Tensor
        ``(P,)``, detached.

    """
    f, diagonal = _summed_diagonal(
        model, root, x, params, lambda f: gradient_seeds(lossfunc, f, y)
    )
    return model_loss(lossfunc, _two_dim(f), y), diagonal


def ggn_kronecker_factors(
    model: nn.Module,
    root: nn.Module,
    lossfunc: nn.Module,
    x: torch.Tensor | Mapping[str, Any],
    y: torch.Tensor,
    params: Sequence[torch.Tensor],
    *,
    stochastic: bool = False,
    approx: str = "expand",
) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Loss and laplace-torch ``Kron`` factors of the GGN (see :mod:`._kronecker`).

    Arguments as for :func:`ggn_diagonal`, and ``approx``, the KFAC setting for
    layers shared over tokens (``'expand'`` or ``'reduce'``).

    Returns
    -------
    loss : torch.Tensor
        Detached.
    factors : list of list of torch.Tensor
        Per parameter ``[F]`` or ``[F0, F1]``: the first sums over the batch, the
        second averages (before laplace-torch's ``M / N`` rescaling).

    """
    sums = KroneckerSums(params, _owners(root, params), approx)
    f = row_chunked_factors(
        model,
        x,
        params,
        lambda f: ggn_seeds(lossfunc, f, stochastic=stochastic),
        sums.add,
        root=root,
    )
    return model_loss(lossfunc, _two_dim(f), y), sums.factors()


def _owners(root: nn.Module, params: Sequence[torch.Tensor]) -> dict[int, nn.Module]:
    """``id(param) -> module`` holding it (attention for its ``out_proj``)."""
    wanted = {id(p) for p in params}
    owners: dict[int, nn.Module] = {}
    for module in owning_modules(root, params):
        recurse = isinstance(module, nn.MultiheadAttention)
        for p in module.parameters(recurse=recurse):
            if id(p) in wanted:
                owners[id(p)] = module
    return owners


def _two_dim(f: torch.Tensor) -> torch.Tensor:
    return f if f.dim() == 2 else f.unsqueeze(1)
