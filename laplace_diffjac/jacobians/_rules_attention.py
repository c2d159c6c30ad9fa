"""Closed-form per-sample Jacobian factors of ``nn.MultiheadAttention``.

Attention of one sample is ``out = concat_h(softmax(Q_h K_hᵀ s + M) V_h) W_oᵀ + b_o``
with ``Q = q W_qᵀ + b_q`` (likewise ``K``, ``V``) and ``s = 1/√d``. From the
signals ``g`` at ``out`` the rule back-propagates by hand through the output
projection, the softmax and the score product (all batched over the V signals and
the samples), giving signals at ``Q``, ``K``, ``V``. Every projection is then a
Linear layer over positions, so its factors are the :class:`Product` and
:class:`Summed` factors of ``nn.Linear``. The attention weights are recomputed from
the recorded inputs (cheap next to the model) with differentiable operations, so
the factors stay connected to the input and the parameters and support double
backward. ``out_proj`` is not called as a module by PyTorch; its parameters belong
to this rule.
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


def attention_factors(
    call: LayerCall, grads: tuple[torch.Tensor | None, ...], wanted: set[int]
) -> list[tuple[int, Factors]]:
    """Factors of ``nn.MultiheadAttention`` for signals at its output.

    Parameters
    ----------
    call : LayerCall
        The recorded call (query, key, value and masks, positional or keyword).
    grads : tuple
        ``(g_out, g_weights)``: ``g_out`` ``(V, batch, T, E)`` (``(V, T, batch, E)``
        unless ``batch_first``); ``g_weights`` must be ``None`` (attention weights
        that influence the output are not supported).
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
        If the returned attention weights influence the model output, or the
        inputs are unbatched.

    """
    m: nn.MultiheadAttention = call.module  # type: ignore[assignment]
    if any(g is not None for g in grads[1:]):
        raise UnsupportedModuleError(
            "The attention weights returned by MultiheadAttention influence the "
            "model output; per-sample Jacobians through them are not supported by "
            "the BackPACK backends (use laplace_diffjac.DiffFuncGGN)."
        )
    q_in, k_in, v_in, mask = _batch_first_inputs(m, call)
    g = grads[0]
    assert g is not None
    g = g if m.batch_first else g.transpose(1, 2)  # (V, B, T, E)
    Q, K, Vv = _projections(m, q_in, k_in, v_in)
    heads, scale = m.num_heads, 1.0 / math.sqrt(m.head_dim)
    A = torch.softmax(Q @ K.transpose(-1, -2) * scale + mask, dim=-1)  # B,h,T,S
    H = _merge(A @ Vv)  # (B, T, E)
    blocks: list[tuple[int, Factors]] = []
    w_o, b_o = m.out_proj.weight, m.out_proj.bias
    if id(w_o) in wanted:
        blocks.append((id(w_o), Product(_rows(g), H)))
    if b_o is not None and id(b_o) in wanted:
        blocks.append((id(b_o), Summed(g.transpose(2, 3))))
    g_h = _split(g @ w_o, heads)  # (V, B, h, T, d)
    g_a = g_h @ Vv.transpose(-1, -2).unsqueeze(0)
    g_v = A.transpose(-1, -2).unsqueeze(0) @ g_h
    g_s = A * (g_a - (g_a * A).sum(-1, keepdim=True)) * scale
    g_q = _merge(g_s @ K.unsqueeze(0))
    g_k = _merge(g_s.transpose(-1, -2) @ Q.unsqueeze(0))
    blocks += _input_projection_factors(
        m, (g_q, g_k, _merge(g_v)), (q_in, k_in, v_in), wanted
    )
    return blocks


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
    q_in, k_in, v_in = inputs
    if q_in is k_in and k_in is v_in:  # self-attention: one product
        factor = Product(_rows(torch.cat(gs, dim=-1)), q_in)
    else:  # block-diagonal over (query, key, value) positions
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
    m: nn.MultiheadAttention, call: LayerCall
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key, value ``(B, T, ·)`` and the additive mask ``(B|1, h|1, T, S)``."""
    bound = _SIGNATURE.bind(m, *call.inputs, **call.kwargs)
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
    mask = q.new_zeros(1, 1, n_q, n_k)
    attn_mask = args["attn_mask"]
    if attn_mask is None and args["is_causal"]:
        attn_mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1)
    if attn_mask is not None:
        am = _additive(attn_mask, q.dtype)
        am = am.view(batch, m.num_heads, n_q, n_k) if am.dim() == 3 else am
        mask = mask + am
    padding = args["key_padding_mask"]
    if padding is not None:
        mask = mask + _additive(padding, q.dtype).view(batch, 1, 1, n_k)
    return q, k, v, mask


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = masked) as ``-inf``; a float mask as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf")
        )
    return mask.to(dtype)


def _projections(
    m: nn.MultiheadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projected query, key and value, split into heads ``(B, h, T, d)``."""
    E = m.embed_dim
    if m.in_proj_weight is not None:
        w_q, w_k, w_v = m.in_proj_weight.split(E)
    else:
        w_q, w_k, w_v = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    b = m.in_proj_bias
    b_q, b_k, b_v = (None, None, None) if b is None else b.split(E)
    return tuple(  # type: ignore[return-value]
        _split(nn.functional.linear(t, w, bias), m.num_heads)
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
