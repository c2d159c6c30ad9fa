"""Closed-form per-sample Jacobian factors of ``nn.LayerNorm`` and ``nn.GroupNorm``.

Both normalise each sample on its own, ``y = x̂ · w + b`` with ``x̂`` the normalised
input, so with signals ``g`` at the output the per-sample weight block is
``Σ_positions g · x̂`` and the bias block ``Σ_positions g``. ``x̂`` is recomputed
from the recorded input with the functional normalisation (no affine part), which
is cheap and keeps the factors differentiable with respect to the input.
"""

from __future__ import annotations

import torch
from torch import nn

from ._assembly import Dense, Factors, Summed
from ._layer_calls import LayerCall


def layer_norm_factors(
    call: LayerCall, grads: tuple[torch.Tensor | None, ...], wanted: set[int]
) -> list[tuple[int, Factors]]:
    """Factors of ``nn.LayerNorm`` for signals ``(V, batch, *, *normalized_shape)``.

    Parameters
    ----------
    call : LayerCall
        The recorded call; ``inputs[0]`` is ``(batch, *, *normalized_shape)``.
    grads : tuple
        ``(g,)`` with ``g`` ``(V, batch, *output_shape)``.
    wanted : set of int
        ``id`` of the parameters of interest.

    Returns
    -------
    list of (int, Factors)
        ``Dense`` weight block ``(V, batch, K)`` and ``Summed`` bias factor.

    """
    module: nn.LayerNorm = call.module  # type: ignore[assignment]
    (g,) = grads[:1]
    assert g is not None
    x = call.inputs[0]
    n_feat = module.weight.numel() if module.weight is not None else 0
    blocks: list[tuple[int, Factors]] = []
    g3 = g.reshape(g.shape[0], g.shape[1], -1, n_feat)  # (V, B, T, K)
    if module.weight is not None and id(module.weight) in wanted:
        x_hat = nn.functional.layer_norm(x, module.normalized_shape, eps=module.eps)
        x_hat = x_hat.reshape(x.shape[0], -1, n_feat)  # (B, T, K)
        block = torch.einsum("vbtk,btk->vbk", g3, x_hat)
        blocks.append((id(module.weight), Dense(block)))
    if module.bias is not None and id(module.bias) in wanted:
        blocks.append((id(module.bias), Summed(g3.transpose(2, 3))))
    return blocks


def group_norm_factors(
    call: LayerCall, grads: tuple[torch.Tensor | None, ...], wanted: set[int]
) -> list[tuple[int, Factors]]:
    """Factors of ``nn.GroupNorm`` for signals ``(V, batch, C, *spatial)``.

    Parameters
    ----------
    call : LayerCall
        The recorded call; ``inputs[0]`` is ``(batch, C, *spatial)``.
    grads : tuple
        ``(g,)`` with ``g`` ``(V, batch, C, *spatial)``.
    wanted : set of int
        ``id`` of the parameters of interest.

    Returns
    -------
    list of (int, Factors)
        ``Dense`` weight block ``(V, batch, C)`` and ``Summed`` bias factor.

    """
    module: nn.GroupNorm = call.module  # type: ignore[assignment]
    (g,) = grads[:1]
    assert g is not None
    x = call.inputs[0]
    g4 = g.reshape(g.shape[0], g.shape[1], module.num_channels, -1)  # (V, B, C, L)
    blocks: list[tuple[int, Factors]] = []
    if module.weight is not None and id(module.weight) in wanted:
        x_hat = nn.functional.group_norm(x, module.num_groups, eps=module.eps)
        x_hat = x_hat.reshape(x.shape[0], module.num_channels, -1)  # (B, C, L)
        blocks.append(
            (id(module.weight), Dense(torch.einsum("vbcl,bcl->vbc", g4, x_hat)))
        )
    if module.bias is not None and id(module.bias) in wanted:
        blocks.append((id(module.bias), Summed(g4)))
    return blocks
