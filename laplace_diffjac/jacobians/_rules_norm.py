"""Closed-form per-sample Jacobian factors of LayerNorm, GroupNorm, InstanceNorm.

All three normalise each sample on its own, ``y = x̂ · w + b`` with ``x̂`` the normalised
input, so with signals ``g`` at the output the per-sample weight block is
``Σ_positions g · x̂`` and the bias block ``Σ_positions g``.

While the engine records the forward pass, :func:`recorded_layer_norm`,
:func:`recorded_group_norm` and :func:`recorded_instance_norm` redo the
normalisation with elementary operations
(mean, variance, ``rsqrt``) and keep ``x̂``: PyTorch's fused ``layer_norm`` and
``group_norm`` kernels have wrong third derivatives (their double backward treats
the saved mean and inverse standard deviation as constants: pytorch/pytorch#175754;
torch 2.14: ``gradgradcheck`` of ``vmap(jacrev)`` of a Linear–LayerNorm–Linear
network fails with respect to the first weight; the gradient of a function of
InstanceNorm's ``vmap(jacrev)`` Jacobians is off by a few per cent), and the
Jacobians' derivatives go through that double backward. The elementary form is
differentiable to every order, and the factors reuse the kept ``x̂``.
"""

from __future__ import annotations

import torch
from torch import nn

from ._assembly import Dense, Factors, Summed
from ._layer_calls import LayerCall, RecordedForward


def recorded_layer_norm(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, torch.Tensor]:
    """``module(*args)`` for an ``nn.LayerNorm``, in elementary operations.

    Parameters
    ----------
    module : torch.nn.LayerNorm
        The module.
    args, kwargs
        The arguments of its call (the input ``(batch, *, *normalized_shape)``).

    Returns
    -------
    call : LayerCall
        The call, ``kwargs["x_hat"]`` the normalised input (no affine part).
    output : torch.Tensor
        ``x̂ · weight + bias``, equal to the module's output.

    """
    m: nn.LayerNorm = module  # type: ignore[assignment]
    (x,) = args
    dims = tuple(range(-len(m.normalized_shape), 0))
    x_hat = _normalised(x, dims, m.eps)
    out = _affine(x_hat, m.weight, m.bias)
    return LayerCall(m, (x,), out, {"x_hat": x_hat}, (out,)), out


def recorded_group_norm(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, torch.Tensor]:
    """``module(*args)`` for an ``nn.GroupNorm``, in elementary operations.

    Parameters
    ----------
    module : torch.nn.GroupNorm
        The module.
    args, kwargs
        The arguments of its call (the input ``(batch, C, *spatial)``).

    Returns
    -------
    call : LayerCall
        The call, ``kwargs["x_hat"]`` the normalised input ``(batch, C, *spatial)``.
    output : torch.Tensor
        Equal to the module's output.

    """
    m: nn.GroupNorm = module  # type: ignore[assignment]
    (x,) = args
    grouped = x.reshape(x.shape[0], m.num_groups, -1)
    x_hat = _normalised(grouped, (-1,), m.eps).reshape(x.shape)
    shape = (1, m.num_channels) + (1,) * (x.dim() - 2)
    weight = None if m.weight is None else m.weight.reshape(shape)
    bias = None if m.bias is None else m.bias.reshape(shape)
    out = _affine(x_hat, weight, bias)
    return LayerCall(m, (x,), out, {"x_hat": x_hat}, (out,)), out


def recorded_instance_norm(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, torch.Tensor]:
    """``module(*args)`` for an ``nn.InstanceNorm1d/2d/3d``, in elementary operations.

    Each sample and channel is normalised over its positions, or, in evaluation
    mode with ``track_running_stats``, with the running statistics.

    Parameters
    ----------
    module : torch.nn.modules.instancenorm._InstanceNorm
        The module (batched input ``(batch, C, *spatial)``).
    args, kwargs
        The arguments of its call.

    Returns
    -------
    call : LayerCall
        The call, ``kwargs["x_hat"]`` the normalised input.
    output : torch.Tensor
        Equal to the module's output.

    """
    m: nn.modules.instancenorm._InstanceNorm = module  # type: ignore[assignment]
    (x,) = args
    shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
    if m.training or not m.track_running_stats:
        x_hat = _normalised(x, tuple(range(2, x.dim())), m.eps)
    else:
        assert m.running_mean is not None and m.running_var is not None
        mean, var = m.running_mean.reshape(shape), m.running_var.reshape(shape)
        x_hat = (x - mean) * torch.rsqrt(var + m.eps)
    weight = None if m.weight is None else m.weight.reshape(shape)
    bias = None if m.bias is None else m.bias.reshape(shape)
    out = _affine(x_hat, weight, bias)
    return LayerCall(m, (x,), out, {"x_hat": x_hat}, (out,)), out


def _normalised(x: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    """``(x − mean) / √(var + eps)`` over ``dims`` (biased variance)."""
    centred = x - x.mean(dims, keepdim=True)
    return centred * torch.rsqrt(centred.square().mean(dims, keepdim=True) + eps)


def _affine(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    out = x if weight is None else x * weight
    return out if bias is None else out + bias


INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

#: The normalisations redone while recording (see the module docstring).
NORM_FORWARDS: dict[type[nn.Module], RecordedForward] = {
    nn.LayerNorm: recorded_layer_norm,
    nn.GroupNorm: recorded_group_norm,
    **{t: recorded_instance_norm for t in INSTANCE_NORMS},
}


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
        x_hat = _kept_x_hat(call).reshape(x.shape[0], -1, n_feat)  # (B, T, K)
        block = torch.einsum("vbtk,btk->vbk", g3, x_hat)
        blocks.append((id(module.weight), Dense(block)))
    if module.bias is not None and id(module.bias) in wanted:
        blocks.append((id(module.bias), Summed(g3.transpose(2, 3))))
    return blocks


def group_norm_factors(
    call: LayerCall, grads: tuple[torch.Tensor | None, ...], wanted: set[int]
) -> list[tuple[int, Factors]]:
    """Factors of ``nn.GroupNorm`` or InstanceNorm for signals ``(V, batch, C, *)``.

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
    module = call.module
    (g,) = grads[:1]
    assert g is not None
    x = call.inputs[0]
    channels = x.shape[1]
    g4 = g.reshape(g.shape[0], g.shape[1], channels, -1)  # (V, B, C, L)
    blocks: list[tuple[int, Factors]] = []
    if module.weight is not None and id(module.weight) in wanted:
        x_hat = _kept_x_hat(call).reshape(x.shape[0], channels, -1)
        blocks.append(
            (id(module.weight), Dense(torch.einsum("vbcl,bcl->vbc", g4, x_hat)))
        )
    if module.bias is not None and id(module.bias) in wanted:
        blocks.append((id(module.bias), Summed(g4)))
    return blocks


def _kept_x_hat(call: LayerCall) -> torch.Tensor:
    """``x̂`` kept by the recorded forward pass."""
    return call.kwargs["x_hat"]
