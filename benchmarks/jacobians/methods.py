"""The Jacobian routes compared, each as ``make(model, n_out) -> jac(x) -> J``.

Every ``jac`` returns graph-connected Jacobians ``(B, C, P)`` (``enable_backprop``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Union

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

Batch = Union[torch.Tensor, dict[str, torch.Tensor]]
JacFn = Callable[[Batch], torch.Tensor]


def per_sample_vmap_jacrev(model: nn.Module, n_out: int) -> JacFn:
    """Plain per-sample ``vmap(jacrev(functional_call))``, written here."""
    params = dict(model.named_parameters())

    def single(p: dict, xi: Batch) -> torch.Tensor:
        if isinstance(xi, dict):
            batch = {k: v[None] for k, v in xi.items()}
            return functional_call(model, p, (batch,)).reshape(-1)
        return functional_call(model, p, (xi.unsqueeze(0),)).reshape(-1)

    def jac(x: Batch) -> torch.Tensor:
        # the composite attention kernel: the fused CPU one has no batching rule
        with sdpa_kernel([SDPBackend.MATH]):
            blocks = vmap(jacrev(single), in_dims=(None, 0))(params, x)
        return torch.cat([b.flatten(start_dim=2) for b in blocks.values()], dim=2)

    return jac


def laplace_backpack(model: nn.Module, n_out: int) -> JacFn:
    """laplace-torch's ``BackPackGGN.jacobians`` (one backward per output)."""
    from laplace.curvature import BackPackGGN

    model.output_size = n_out
    backend = BackPackGGN(model, "classification")
    return lambda x: backend.jacobians(x, enable_backprop=True)[0]


def laplace_jacrev(model: nn.Module, n_out: int) -> JacFn:
    """laplace-torch's ``CurvatureInterface.jacobians``: whole-batch ``jacrev``."""
    from laplace.curvature import CurvatureInterface, GGNInterface

    backend = GGNInterface(model, "classification")
    return lambda x: CurvatureInterface.jacobians(backend, x, enable_backprop=True)[0]


def diff_backpack(model: nn.Module, n_out: int) -> JacFn:
    """``laplace_diffjac.DiffBackPackGGN``."""
    from laplace_diffjac import DiffBackPackGGN

    backend = DiffBackPackGGN(model, "classification")
    return lambda x: backend.jacobians(x, enable_backprop=True)[0]


def diff_func(model: nn.Module, n_out: int) -> JacFn:
    """``laplace_diffjac.DiffFuncGGN``."""
    from laplace_diffjac import DiffFuncGGN

    backend = DiffFuncGGN(model, "classification")
    return lambda x: backend.jacobians(x, enable_backprop=True)[0]


#: Jacobian routes, in table order; the first is the baseline of the ratios.
JACOBIAN_METHODS: dict[str, Callable[[nn.Module, int], JacFn]] = {
    "lt_BackPackGGN": laplace_backpack,
    "lt_jacrev_batch": laplace_jacrev,
    "vmap_jacrev": per_sample_vmap_jacrev,
    "DiffFuncGGN": diff_func,
    "DiffBackPackGGN": diff_backpack,
}

#: Routes that take dict-like (token) batches; laplace-torch's refuse them.
DICT_METHODS = ("vmap_jacrev", "DiffFuncGGN", "DiffBackPackGGN")

#: The torch.func routes; ratios are also given against the fastest of them.
TORCH_FUNC_METHODS = ("lt_jacrev_batch", "vmap_jacrev", "DiffFuncGGN")


def reference_jacobians(model64: nn.Module, x: Batch) -> torch.Tensor:
    """Float64 per-sample reference ``(B, C, P)``.

    ``model64`` is a separately built float64 copy of the benchmarked model; the
    result is differentiable with respect to ``x`` (float64) and the parameters.
    Tensor batches use ``vmap(jacrev)``; dict (token) batches, whose models hold
    LayerNorm layers, plain autograd per sample and output, because the second
    derivatives of ``vmap(jacrev)`` through ``layer_norm`` are wrong in torch 2.14.
    """
    if not isinstance(x, dict):
        return per_sample_vmap_jacrev(model64, 0)(x)
    with sdpa_kernel([SDPBackend.MATH]):  # differentiable twice
        return _autograd_reference(model64, x)


def _autograd_reference(model64: nn.Module, x: dict) -> torch.Tensor:
    params = list(model64.parameters())
    rows = []
    for i in range(len(x["input_ids"])):
        out = model64({k: v[i : i + 1] for k, v in x.items()}).reshape(-1)
        rows.append(
            torch.stack(
                [
                    torch.cat(
                        [
                            (torch.zeros_like(p) if g is None else g).flatten()
                            for g, p in zip(
                                torch.autograd.grad(
                                    o, params, create_graph=True, allow_unused=True
                                ),
                                params,
                            )
                        ]
                    )
                    for o in out
                ]
            )
        )
    return torch.stack(rows)
