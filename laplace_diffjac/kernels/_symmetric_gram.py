"""``J(Z) J(Z)ᵀ`` from one side's features, with a backward pass for symmetric use.

The Gram of a batch with itself is symmetric, so whatever consumes it sees only
its symmetric part; when the consumer's gradient is symmetric too (as the
gradient of :func:`laplace_diffjac.kernels.explained_trace` with respect to
``K_ZZ`` is), the gradient of each layer's signal is ``2 (Γ ⊙ S) g``: one
product per layer instead of autograd's two, and no intermediate ``(MC)²``
tensors beyond one per layer. This is the largest share of an optimiser step on
the structured route after the Cholesky factorisation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ._products import layer_scale, scaled_gram_sum, symmetric_product
from ._structured_features import NTKFeatures

__all__ = ["symmetric_feature_gram"]


def symmetric_feature_gram(
    f: NTKFeatures, factor: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """``factor · J(x) J(x)ᵀ`` ``(B C, B C)``, input-major, for symmetric consumers.

    Parameters
    ----------
    f : NTKFeatures
        Features of ``B`` inputs.
    factor : float or torch.Tensor, default=1.0
        Scalar factor (not differentiated).

    Returns
    -------
    torch.Tensor
        ``(B C, B C)``, equal to ``feature_gram(f, f, factor)``. Differentiable
        once with respect to the features, **assuming the incoming gradient is
        symmetric** (true for any function of the matrix that treats it as
        symmetric, e.g. through its Cholesky factor with a symmetric gradient).

    """
    like = f.inputs[0]
    factor = torch.as_tensor(factor, dtype=like.dtype, device=like.device).detach()
    signals = tuple(g if g is not None else f.inputs[0][:0] for g in f.signals)
    meta = (f.weight, f.bias, tuple(g is None for g in f.signals), f.n_outputs)
    return _SymmetricGram.apply(meta, factor, len(f.inputs), *f.inputs, *signals)


class _SymmetricGram(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, meta: tuple, factor: torch.Tensor, k: int, *tensors: torch.Tensor
    ) -> torch.Tensor:
        weight, bias, identity, c = meta
        inputs, signals = tensors[:k], tensors[k:]
        n = inputs[0].shape[0]

        def terms() -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
            for a, g, w, b, eye in zip(inputs, signals, weight, bias, identity):
                scale = layer_scale(a, a, w, b) * factor
                if eye:
                    yield scale, None
                else:
                    g_flat = g.reshape(n * c, -1)
                    yield scale, symmetric_product(g_flat, g_flat).view(n, c, n, c)

        kernel, grams = scaled_gram_sum(terms(), (n, c, n, c), inputs[0])
        ctx.meta, ctx.k, ctx.grams = meta, k, grams
        ctx.save_for_backward(factor, *tensors)
        return kernel.reshape(n * c, n * c)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        weight, bias, identity, c = ctx.meta
        factor, *tensors = ctx.saved_tensors
        inputs, signals = tensors[: ctx.k], tensors[ctx.k :]
        n = inputs[0].shape[0]
        G = grad.reshape(n, c, n, c)
        grads_a: list[torch.Tensor | None] = []
        grads_g: list[torch.Tensor | None] = []
        work = None  # one (n, c, n, c) buffer for every layer's products
        layers = zip(inputs, signals, weight, bias, identity, ctx.grams)
        for a, g, w, b, eye, gram in layers:
            if eye:
                grad_scale = G.diagonal(dim1=1, dim2=3).sum(-1)
                grads_g.append(None)
            else:
                work = torch.empty_like(G) if work is None else work
                scale = layer_scale(a, a, w, b) * factor
                T = torch.mul(G, scale[:, None, :, None], out=work)
                # T is symmetric: (gᵀ T)ᵀ = T g, the faster orientation for BLAS
                g_T = torch.mm(g.reshape(n * c, -1).T, T.view(n * c, n * c)).mul_(2)
                grads_g.append(g_T.T.reshape(g.shape))
                grad_scale = torch.mul(G, gram, out=work).sum(dim=(1, 3))
            grads_a.append(2 * factor * (grad_scale @ a) if w else None)
        return (None, None, None, *grads_a, *grads_g)
