"""``J(x1) J(x2)ᵀ`` from two sides' features when only the first side is differentiated.

The location optimiser pairs the locations' features (with graph) with the
training inputs' cached features (detached). Autograd through
:func:`~laplace_diffjac.kernels.feature_gram` is correct but slow here: its
backward multiplies an ``(B1 C, B2 C)`` gradient by each layer's skinny signal
matrix in an orientation BLAS handles badly, and keeps intermediate
``(B1, C, B2, C)`` tensors per layer. This Function keeps one Gram per layer and
computes the first side's gradients only (``2`` elementwise passes and one
product per layer).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ._products import layer_scale, scaled_gram_sum
from ._structured_features import NTKFeatures, aligned, feature_gram

__all__ = ["cross_feature_gram"]


def cross_feature_gram(
    f1: NTKFeatures, f2: NTKFeatures, factor: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """``factor · J(x1) J(x2)ᵀ`` ``(B1 C, B2 C)``, input-major, as :func:`feature_gram`.

    Parameters
    ----------
    f1 : NTKFeatures
        Features of ``B1`` inputs (may carry a graph).
    f2 : NTKFeatures
        Features of ``B2`` inputs of the same model; when any of them requires
        grad, this is :func:`feature_gram` (plain autograd).
    factor : float or torch.Tensor, default=1.0
        Scalar factor (not differentiated).

    Returns
    -------
    torch.Tensor
        ``(B1 C, B2 C)``, equal to ``feature_gram(f1, f2, factor)``;
        differentiable once with respect to ``f1``.

    """
    f1, f2 = aligned(f1, f2)
    second = [*f2.inputs, *(g for g in f2.signals if g is not None)]
    if any(t.requires_grad for t in second) or (
        isinstance(factor, torch.Tensor) and factor.requires_grad
    ):
        return feature_gram(f1, f2, factor)
    like = f1.inputs[0]
    factor = torch.as_tensor(factor, dtype=like.dtype, device=like.device)
    k = len(f1.inputs)
    empty = like[:0]
    signals1 = tuple(empty if g is None else g for g in f1.signals)
    signals2 = tuple(empty if g is None else g for g in f2.signals)
    meta = (f1.weight, f1.bias, tuple(g is None for g in f1.signals), f1.n_outputs)
    return _CrossGram.apply(
        meta, factor, k, *f1.inputs, *signals1, *f2.inputs, *signals2
    )


class _CrossGram(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, meta: tuple, factor: torch.Tensor, k: int, *tensors: torch.Tensor
    ) -> torch.Tensor:
        weight, bias, identity, c = meta
        a1s, g1s, a2s, g2s = (tensors[i * k : (i + 1) * k] for i in range(4))
        n1, n2 = a1s[0].shape[0], a2s[0].shape[0]

        def terms() -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
            layers = zip(a1s, g1s, a2s, g2s, weight, bias, identity)
            for a1, g1, a2, g2, w, b, eye in layers:
                scale = layer_scale(a1, a2, w, b) * factor
                if eye:
                    yield scale, None
                else:
                    g1_flat, g2_flat = g1.reshape(n1 * c, -1), g2.reshape(n2 * c, -1)
                    yield scale, (g1_flat @ g2_flat.T).view(n1, c, n2, c)

        kernel, grams = scaled_gram_sum(terms(), (n1, c, n2, c), a1s[0])
        ctx.meta, ctx.k, ctx.grams = meta, k, grams
        ctx.save_for_backward(factor, *tensors)
        return kernel.reshape(n1 * c, n2 * c)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        weight, bias, identity, c = ctx.meta
        factor, *tensors = ctx.saved_tensors
        k = ctx.k
        a1s, g1s, a2s, g2s = (tensors[i * k : (i + 1) * k] for i in range(4))
        n1, n2 = a1s[0].shape[0], a2s[0].shape[0]
        G = grad.reshape(n1, c, n2, c)
        grads_a: list[torch.Tensor | None] = []
        grads_g: list[torch.Tensor | None] = []
        work = None  # one (n1, c, n2, c) buffer for every layer's products
        layers = zip(a1s, g1s, a2s, g2s, weight, bias, identity, ctx.grams)
        for a1, g1, a2, g2, w, b, eye, gram in layers:
            if eye:
                grad_scale = G.diagonal(dim1=1, dim2=3).sum(-1)
                grads_g.append(None)
            else:
                work = torch.empty_like(G) if work is None else work
                scale = layer_scale(a1, a2, w, b) * factor
                T = torch.mul(G, scale[:, None, :, None], out=work)
                T2 = T.view(n1 * c, n2 * c)
                g_T = torch.mm(g2.reshape(n2 * c, -1).T, T2.T)  # (T g2)ᵀ
                grads_g.append(g_T.T.reshape(g1.shape))
                grad_scale = torch.mul(G, gram, out=work).sum(dim=(1, 3))
            grads_a.append(factor * (grad_scale @ a2) if w else None)
        none = (None,) * (2 * k)
        return (None, None, None, *grads_a, *grads_g, *none)
