"""Per-sample Jacobian factors of ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``.

Every weight of a recurrent layer enters through a pre-activation that is a Linear
map over time: ``a_ih[t] = W_ih x[t] + b_ih`` and ``a_hh[t] = W_hh h[t-1] + b_hh``
(and, for LSTMs with ``proj_size``, ``h[t] = W_hr m[t]``). The per-sample weight
blocks are therefore :class:`Product` factors of the signals at those
pre-activations and the recorded inputs and states, exactly as for ``nn.Linear``.

The signals at the pre-activations need back-propagation through time. The rule
unrolls the layer once more from its recorded input and initial state with
ordinary differentiable operations (the same equations as PyTorch's kernels, one
cell per step) and sends the module's output signals (sequence output and final
states, all V at once) back to the pre-activations with one batched
``torch.autograd.grad``. The model itself runs once; with ``enable_backprop`` the
gradient is taken with ``create_graph=True``, so the factors stay connected to the
input and the parameters and support double backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import UnsupportedModuleError
from ._assembly import Factors, Product, Summed
from ._layer_calls import LayerCall

RECURRENT = (nn.RNN, nn.LSTM, nn.GRU)

#: Module types that ``vmap`` over samples cannot run: under ``vmap`` a cell
#: creates its zero state unbatched and writes the batched result into it
#: (``LSTMCell``'s ``torch.func`` derivatives come out wrong), and the fused
#: kernels of the layers have no batching rule.
SAMPLE_BY_SAMPLE = (nn.RNNBase, nn.RNNCellBase)


def unsupported_reason(module: nn.RNNBase) -> str | None:
    """Why the rule cannot handle ``module``, or ``None`` if it can."""
    if module.training and module.dropout > 0 and module.num_layers > 1:
        return f"{type(module).__name__} with active dropout; call model.eval()"
    return None


@dataclass
class _Trace:
    """What one direction of one layer saw: inputs, states, pre-activations."""

    x: torch.Tensor  # (B, T, in), processing order
    a_ih: torch.Tensor  # (B, T, G)
    h_prev: list[torch.Tensor] = field(default_factory=list)  # T x (B, H_out)
    a_hh: list[torch.Tensor] = field(default_factory=list)  # T x (B, G)
    m: list[torch.Tensor] = field(default_factory=list)  # LSTM proj: T x (B, H)
    h: list[torch.Tensor] = field(default_factory=list)  # LSTM proj: T x (B, P)


def recurrent_factors(
    call: LayerCall, grads: tuple[torch.Tensor | None, ...], wanted: set[int]
) -> list[tuple[int, Factors]]:
    """Factors of a recurrent layer for signals at its outputs.

    Parameters
    ----------
    call : LayerCall
        The recorded call: ``inputs`` ``(x, hx)``, ``x`` ``(batch, T, in)`` if
        ``batch_first`` else ``(T, batch, in)``.
    grads : tuple
        Signals ``(V, ...)`` at the sequence output, ``h_n`` (and ``c_n``);
        ``None`` where an output does not influence the model output.
    wanted : set of int
        ``id`` of the parameters of interest.

    Returns
    -------
    list of (int, Factors)
        ``Product`` factors of every weight, ``Summed`` factors of every bias.

    Raises
    ------
    UnsupportedModuleError
        For unbatched (2-D) or packed inputs.

    """
    m: nn.RNNBase = call.module  # type: ignore[assignment]
    x, hx = _inputs(m, call)
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        outputs, traces = _unroll(m, x, hx)
        pairs = [(o, g) for o, g in zip(outputs, _layout(m, grads)) if g is not None]
        targets = [t for tr in traces.values() for t in _targets(tr)]
        found = torch.autograd.grad(
            [o for o, _ in pairs],
            targets,
            [g for _, g in pairs],
            create_graph=create_graph,
            allow_unused=True,
            is_grads_batched=True,
        )
    n_rows = pairs[0][1].shape[0]
    signals = [
        torch.zeros((n_rows, *t.shape), dtype=t.dtype, device=t.device)
        if g is None
        else g
        for g, t in zip(found, targets)
    ]
    blocks: list[tuple[int, Factors]] = []
    i = 0
    for suffix, tr in traces.items():
        n = len(_targets(tr))
        blocks += _layer_factors(m, suffix, tr, signals[i : i + n], wanted)
        i += n
    return blocks


def _targets(tr: _Trace) -> list[torch.Tensor]:
    return [tr.a_ih, *tr.a_hh, *tr.h]


def _layer_factors(
    m: nn.RNNBase,
    suffix: str,
    tr: _Trace,
    signals: list[torch.Tensor],
    wanted: set[int],
) -> list[tuple[int, Factors]]:
    """Product/Summed factors of one layer direction from its signals."""
    steps = tr.a_ih.shape[1]
    g_ih = signals[0]  # (V, B, T, G)
    g_hh = torch.stack(signals[1 : 1 + steps], dim=2)
    blocks: list[tuple[int, Factors]] = []
    pairs = [("ih", g_ih, tr.x), ("hh", g_hh, torch.stack(tr.h_prev, dim=1))]
    if tr.h:
        g_h = torch.stack(signals[1 + steps :], dim=2)
        pairs.append(("hr", g_h, torch.stack(tr.m, dim=1)))
    for kind, g, a in pairs:
        w = getattr(m, f"weight_{kind}_l{suffix}")
        if id(w) in wanted:
            blocks.append((id(w), Product(g.permute(1, 0, 3, 2).contiguous(), a)))
        b = getattr(m, f"bias_{kind}_l{suffix}", None) if kind != "hr" else None
        if b is not None and id(b) in wanted:
            blocks.append((id(b), Summed(g.transpose(2, 3))))
    return blocks


def refuse_packed_sequence(module: nn.Module, inputs: tuple) -> None:
    """Raise if a recurrent layer is called with a ``PackedSequence``.

    Raises
    ------
    UnsupportedModuleError
        Naming the layer and the fix; no backend of this package differentiates
        packed sequences sample by sample.

    """
    if inputs and isinstance(inputs[0], nn.utils.rnn.PackedSequence):
        raise UnsupportedModuleError(
            f"{type(module).__name__} got a PackedSequence, whose samples no "
            "backend of this package can tell apart; run the layer on the padded "
            "batch and read each sequence's output at its length instead."
        )


def _inputs(
    m: nn.RNNBase, call: LayerCall
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Batch-first input ``(B, T, in)`` and the initial state(s) ``(L·D, B, H)``."""
    x = call.inputs[0]
    hx = call.inputs[1] if len(call.inputs) > 1 else call.kwargs.get("hx")
    refuse_packed_sequence(m, call.inputs)
    if x.dim() != 3:
        raise UnsupportedModuleError(
            f"{type(m).__name__} got an unbatched (2-D) input; the BackPACK backends "
            "need batched (3-D) inputs."
        )
    x = x if m.batch_first else x.transpose(0, 1)
    if hx is not None and isinstance(hx, torch.Tensor):
        hx = (hx,)
    return x, hx


def _layout(
    m: nn.RNNBase, grads: tuple[torch.Tensor | None, ...]
) -> list[torch.Tensor | None]:
    """Signals at (output, h_n[, c_n]) with the output batch-first."""
    out = grads[0]
    if out is not None and not m.batch_first:
        out = out.transpose(1, 2)
    return [out, *grads[1:]]


def _unroll(
    m: nn.RNNBase, x: torch.Tensor, hx: tuple[torch.Tensor, ...] | None
) -> tuple[list[torch.Tensor], dict[str, _Trace]]:
    """Recompute the layer; return (output, h_n[, c_n]) and the traces."""
    dirs = 2 if m.bidirectional else 1
    h_size = m.proj_size if getattr(m, "proj_size", 0) else m.hidden_size
    batch = x.shape[0]
    traces: dict[str, _Trace] = {}
    h_n: list[torch.Tensor] = []
    c_n: list[torch.Tensor] = []
    for layer in range(m.num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            h0 = x.new_zeros(batch, h_size) if hx is None else hx[0][k]
            c0 = None
            if isinstance(m, nn.LSTM):
                c0 = x.new_zeros(batch, m.hidden_size) if hx is None else hx[1][k]
            suffix = f"{layer}{'_reverse' if d else ''}"
            seq = x.flip(1) if d else x
            out, h, c, traces[suffix] = _direction(m, suffix, seq, h0, c0)
            outs.append(out.flip(1) if d else out)
            h_n.append(h)
            if c is not None:
                c_n.append(c)
        x = torch.cat(outs, dim=2) if dirs > 1 else outs[0]
    results = [x, torch.stack(h_n)]
    if isinstance(m, nn.LSTM):
        results.append(torch.stack(c_n))
    return results, traces


def _direction(
    m: nn.RNNBase,
    suffix: str,
    x: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, _Trace]:
    """Run one direction of one layer over ``x`` ``(B, T, in)`` step by step."""
    w_hh = getattr(m, f"weight_hh_l{suffix}")
    b_hh = getattr(m, f"bias_hh_l{suffix}", None)
    w_hr = getattr(m, f"weight_hr_l{suffix}", None)
    a_ih = nn.functional.linear(
        x, getattr(m, f"weight_ih_l{suffix}"), getattr(m, f"bias_ih_l{suffix}", None)
    )
    tr = _Trace(x=x, a_ih=_trackable(a_ih))
    outs = []
    for t in range(x.shape[1]):
        a_hh = _trackable(nn.functional.linear(h, w_hh, b_hh))
        tr.h_prev.append(h)
        tr.a_hh.append(a_hh)
        if isinstance(m, nn.LSTM):
            assert c is not None  # an LSTM always carries its cell state
            h, c = _lstm_cell(a_ih[:, t], a_hh, c)
            if w_hr is not None:
                tr.m.append(h)
                h = _trackable(h @ w_hr.T)
                tr.h.append(h)
        elif isinstance(m, nn.GRU):
            h = _gru_cell(a_ih[:, t], a_hh, h)
        else:
            pre = a_ih[:, t] + a_hh
            h = torch.tanh(pre) if m.nonlinearity == "tanh" else torch.relu(pre)
        outs.append(h)
    return torch.stack(outs, dim=1), h, c, tr


def _trackable(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the graph even where nothing upstream requires grad (frozen)."""
    return t if t.requires_grad else t.requires_grad_(True)


def _lstm_cell(
    a_ih: torch.Tensor, a_hh: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    i, f, g, o = (a_ih + a_hh).chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _gru_cell(a_ih: torch.Tensor, a_hh: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    i_r, i_z, i_n = a_ih.chunk(3, dim=1)
    h_r, h_z, h_n = a_hh.chunk(3, dim=1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return (1 - z) * n + z * h
