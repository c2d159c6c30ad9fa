"""Per-sample Jacobian factors of ``nn.MultiheadAttention``, from its projections.

Attention of one sample is ``out = concat_h(softmax(Q_h K_hᵀ s + M) V_h) W_oᵀ + b_o``
with ``Q = q W_qᵀ + b_q`` (likewise ``K``, ``V``) and ``s = 1/√d``: every parameter
sits in a Linear map over positions. While the engine records the forward pass,
:func:`recorded_forward` replaces the module's output by the same attention written
with plain operations, keeping the projections ``Q, K, V`` (one ``(B, T, 3E)``
tensor for self-attention) and the merged heads ``H`` as tensors. The engine's one
batched backward then delivers signals at the output and at the projections (it
goes through the softmax anyway to reach the layers below), and the factors are
those of ``nn.Linear``: :class:`Product` and :class:`Summed`. No backward through
the softmax is written by hand or run twice, and the factors stay connected to the
input and the parameters. ``out_proj`` is not called as a module by PyTorch; its
parameters belong to this rule.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from ..errors import UnsupportedModuleError
from ._assembly import Factors, Product, Summed
from ._layer_calls import LayerCall

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def unsupported_reason(module: nn.MultiheadAttention) -> str | None:
    """Why the rule cannot handle ``module``, or ``None`` if it can."""
    if module.bias_k is not None or module.add_zero_attn:
        return "MultiheadAttention with add_bias_kv or add_zero_attn"
    if module.training and module.dropout > 0:
        return "MultiheadAttention with active dropout; call model.eval()"
    return None


def recorded_forward(
    module: nn.Module, args: tuple, kwargs: dict
) -> tuple[LayerCall, tuple[torch.Tensor, torch.Tensor | None]]:
    """The attention of ``module(*args, **kwargs)`` with its projections kept.

    Parameters
    ----------
    module : torch.nn.MultiheadAttention
        The module (supported configuration, see :func:`unsupported_reason`).
    args, kwargs
        The arguments of its call.

    Returns
    -------
    call : LayerCall
        ``inputs`` ``(q, k, v, H)`` batch first, ``(B, T, ·)``; ``outputs``
        ``(out, *projections, [weights])``: the output ``(B, T, E)``, the
        projections ``(B, T, 3E)`` (self-attention) or ``Q, K, V``, and the
        returned attention weights if any.
    output : tuple
        ``(attn_output, attn_weights)`` as ``module.forward`` returns them.

    Raises
    ------
    UnsupportedModuleError
        If the inputs are unbatched.

    """
    m: nn.MultiheadAttention = module  # type: ignore[assignment]
    q_in, k_in, v_in, mask, args_ = _batch_first_inputs(m, args, kwargs)
    projections = _projections(m, q_in, k_in, v_in)
    E, heads = m.embed_dim, m.num_heads
    qkv = projections[0].split(E, -1) if len(projections) == 1 else projections
    Q, K, Vv = (_split(t, heads) for t in qkv)
    # scaling Q (B, h, T, d), not the scores (B, h, T, S): a smaller backward
    scores = (Q * (1.0 / math.sqrt(m.head_dim))) @ K.transpose(-1, -2)
    if mask is not None:
        scores = scores + mask
    A = torch.softmax(scores, dim=-1)  # (B, h, T, S)
    H = _merge(A @ Vv)  # (B, T, E)
    out = nn.functional.linear(H, m.out_proj.weight, m.out_proj.bias)
    weights = None
    if args_["need_weights"]:
        weights = A.mean(1) if args_["average_attn_weights"] else A
    targets = (out, *projections, *(() if weights is None else (weights,)))
    call = LayerCall(
        m, (q_in, k_in, v_in, H), out, {"n_proj": len(projections)}, targets
    )
    return call, (out if m.batch_first else out.transpose(0, 1), weights)


def attention_factors(
    call: LayerCall, grads: tuple[torch.Tensor | None, ...], wanted: set[int]
) -> list[tuple[int, Factors]]:
    """Factors of ``nn.MultiheadAttention`` from signals at its output and projections.

    Parameters
    ----------
    call : LayerCall
        A call recorded by :func:`recorded_forward`.
    grads : tuple
        Signals ``(V, B, T, ·)`` at ``call.outputs``: output, projections and the
        attention weights (whose signals must be ``None``).
    wanted : set of int
        ``id`` of the parameters of interest.

    Returns
    -------
    list of (int, Factors)
        Factors of ``in_proj_weight`` (or ``q/k/v_proj_weight``), ``in_proj_bias``,
        ``out_proj.weight`` and ``out_proj.bias``.

    Raises
    ------
    UnsupportedModuleError
        If the returned attention weights influence the model output.

    """
    m: nn.MultiheadAttention = call.module  # type: ignore[assignment]
    q_in, k_in, v_in, H = call.inputs
    n_proj = call.kwargs["n_proj"]
    if len(grads) > 1 + n_proj and grads[1 + n_proj] is not None:
        raise UnsupportedModuleError(
            "The attention weights returned by MultiheadAttention influence the "
            "model output; per-sample Jacobians through them are not supported by "
            "the BackPACK backends (use laplace_diffjac.DiffFuncGGN)."
        )
    blocks: list[tuple[int, Factors]] = []
    g = grads[0]
    w_o, b_o = m.out_proj.weight, m.out_proj.bias
    if g is not None and id(w_o) in wanted:
        blocks.append((id(w_o), Product(_rows(g), H)))
    if g is not None and b_o is not None and id(b_o) in wanted:
        blocks.append((id(b_o), Summed(g.transpose(2, 3))))
    if g is None:
        return blocks
    gs = [
        _zeros_if_none(t, like, g.shape[0])
        for t, like in zip(grads[1 : 1 + n_proj], call.outputs[1:])
    ]
    if n_proj == 1:  # self-attention, packed weights: one Linear (E -> 3E)
        blocks += _packed_factors(m, gs[0], q_in, wanted)
    else:
        g_q, g_k, g_v = gs  # separate q, k, v projections
        blocks += _input_projection_factors(
            m, (g_q, g_k, g_v), (q_in, k_in, v_in), wanted
        )
    return blocks


def _packed_factors(
    m: nn.MultiheadAttention, g: torch.Tensor, x: torch.Tensor, wanted: set[int]
) -> list[tuple[int, Factors]]:
    """Factors of the packed projection from signals ``(V, B, T, 3E)`` at it."""
    blocks: list[tuple[int, Factors]] = []
    if id(m.in_proj_weight) in wanted:
        blocks.append((id(m.in_proj_weight), Product(_rows(g), x)))
    if m.in_proj_bias is not None and id(m.in_proj_bias) in wanted:
        blocks.append((id(m.in_proj_bias), Summed(g.transpose(2, 3))))
    return blocks


def _zeros_if_none(
    g: torch.Tensor | None, like: torch.Tensor, n_rows: int
) -> torch.Tensor:
    """A signal that did not reach a projection as zeros ``(V, *like.shape)``."""
    return like.new_zeros(()).expand(n_rows, *like.shape) if g is None else g


def _input_projection_factors(
    m: nn.MultiheadAttention,
    gs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    wanted: set[int],
) -> list[tuple[int, Factors]]:
    """Factors of the q/k/v projections from their signals ``(V, B, T, E)``."""
    blocks: list[tuple[int, Factors]] = []
    if m.in_proj_bias is not None and id(m.in_proj_bias) in wanted:
        summed = torch.cat([g.sum(2) for g in gs], dim=-1).unsqueeze(3)
        blocks.append((id(m.in_proj_bias), Summed(summed)))
    if m.in_proj_weight is None:
        weights = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
        for w, g, a in zip(weights, gs, inputs):
            if id(w) in wanted:
                blocks.append((id(w), Product(_rows(g), a)))
        return blocks
    if id(m.in_proj_weight) not in wanted:
        return blocks
    # block-diagonal over (query, key, value) positions
    rows = [_rows(g) for g in gs]  # (B, V, E, T_i)
    sizes = [r.shape[3] for r in rows]
    padded = [
        nn.functional.pad(r, (sum(sizes[:i]), sum(sizes[i + 1 :])))
        for i, r in enumerate(rows)
    ]
    factor = Product(torch.cat(padded, dim=2), torch.cat(inputs, dim=1))
    blocks.append((id(m.in_proj_weight), factor))
    return blocks


def _batch_first_inputs(
    m: nn.MultiheadAttention, call_args: tuple, call_kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, dict]:
    """Inputs of a call, batch first, with its additive mask.

    Returns
    -------
    q, k, v : torch.Tensor
        ``(B, T, ·)``; ``k`` and ``v`` are ``q`` itself for self-attention.
    mask : torch.Tensor or None
        Additive mask ``(B|1, h|1, T, S)``; ``None`` without masks.
    args : dict
        Every argument of the call by name, defaults filled in.

    Raises
    ------
    UnsupportedModuleError
        If the inputs are unbatched (2-D).

    """
    bound = _SIGNATURE.bind(m, *call_args, **call_kwargs)
    bound.apply_defaults()
    args = bound.arguments
    q, k, v = args["query"], args["key"], args["value"]
    if q.dim() != 3:
        raise UnsupportedModuleError(
            "MultiheadAttention got unbatched (2-D) inputs; the BackPACK backends "
            "need batched (3-D) inputs."
        )
    if not m.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    if args["query"] is args["key"] and args["key"] is args["value"]:
        k = v = q  # keep identity: one product for self-attention
    batch, n_q, n_k = q.shape[0], q.shape[1], k.shape[1]
    mask: torch.Tensor | None = None
    attn_mask = args["attn_mask"]
    if attn_mask is None and args["is_causal"]:
        attn_mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1)
    if attn_mask is not None:
        am = _additive(attn_mask, q.dtype)
        mask = am.view(batch, m.num_heads, n_q, n_k) if am.dim() == 3 else am
    padding = args["key_padding_mask"]
    if padding is not None:
        by_key = _additive(padding, q.dtype).view(batch, 1, 1, n_k)
        mask = by_key if mask is None else mask + by_key
    return q, k, v, mask, args


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = masked) as ``-inf``; a float mask as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf")
        )
    return mask.to(dtype)


def _projections(
    m: nn.MultiheadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Projected query, key and value.

    Returns
    -------
    tuple of torch.Tensor
        ``Q, K, V`` ``(B, T, E)``; one ``(B, T, 3E)`` tensor for self-attention
        with the packed ``in_proj_weight``.

    """
    if m.in_proj_weight is not None and q is k and k is v:
        return (nn.functional.linear(q, m.in_proj_weight, m.in_proj_bias),)
    E = m.embed_dim
    if m.in_proj_weight is not None:
        w_q, w_k, w_v = m.in_proj_weight.split(E)
    else:
        w_q, w_k, w_v = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    b = m.in_proj_bias
    b_q, b_k, b_v = (None, None, None) if b is None else b.split(E)
    return tuple(
        nn.functional.linear(t, w, bias)
        for t, w, bias in ((q, w_q, b_q), (k, w_k, b_k), (v, w_v, b_v))
    )


def _split(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``(..., T, E)`` as ``(..., h, T, E/h)``."""
    return t.unflatten(-1, (heads, -1)).transpose(-2, -3)


def _merge(t: torch.Tensor) -> torch.Tensor:
    """``(..., h, T, d)`` as ``(..., T, h·d)``."""
    return t.transpose(-2, -3).flatten(-2)


def _rows(g: torch.Tensor) -> torch.Tensor:
    """Signals ``(V, B, T, out)`` as the ``(B, V, out, T)`` left factor of Product."""
    return g.permute(1, 0, 3, 2).contiguous()
