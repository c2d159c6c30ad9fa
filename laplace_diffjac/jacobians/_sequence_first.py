"""Run sequence-first transformer encoder layers batch first while recording.

``nn.TransformerEncoderLayer`` defaults to ``batch_first=False``: its Linear and
LayerNorm submodules then see ``(T, B, E)``, and their rules, which take the first
dimension as the batch, would mix the samples. Inside :func:`batch_first_encoders`
each such layer gets its input transposed to ``(B, T, E)`` and its attention's
``batch_first`` flag set for the duration of its call; its output is transposed back,
so the model sees the same values in the same layout. Masks need no change (the
attention mask is ``(T, S)`` or ``(B·h, T, S)`` and the padding mask ``(B, S)`` in
either layout). The flags are put back after every call and on exit, also after an
exception.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import torch
from torch import nn


def sequence_first_encoders(model: nn.Module) -> list[nn.TransformerEncoderLayer]:
    """Encoder layers of ``model`` whose attention is not batch first.

    Returns
    -------
    list of torch.nn.TransformerEncoderLayer
        In ``model.modules()`` order.

    """
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.TransformerEncoderLayer) and not m.self_attn.batch_first
    ]


@contextmanager
def batch_first_encoders(model: nn.Module) -> Iterator[None]:
    """Run the sequence-first encoder layers of ``model`` batch first inside.

    Parameters
    ----------
    model : torch.nn.Module
        The model; its layers are found by :func:`sequence_first_encoders`.

    Yields
    ------
    None

    """
    layers = sequence_first_encoders(model)

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            src, rest = args[0], args[1:]
        else:
            src, rest = kwargs.pop("src"), ()
        if src.dim() == 3:  # unbatched inputs stay as they are (and are refused)
            _attention(module).batch_first = True
            src = src.transpose(0, 1)
        return (src, *rest), kwargs

    def after(module: nn.Module, args: tuple, kwargs: dict, out: object) -> object:
        if not _attention(module).batch_first:
            return None
        _attention(module).batch_first = False
        return out.transpose(0, 1) if isinstance(out, torch.Tensor) else None

    handles = [
        handle
        for layer in layers
        for handle in (
            layer.register_forward_pre_hook(before, with_kwargs=True),
            layer.register_forward_hook(after, with_kwargs=True),
        )
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for layer in layers:
            layer.self_attn.batch_first = False


def _attention(layer: nn.Module) -> nn.MultiheadAttention:
    """The self-attention of an encoder layer."""
    return cast(nn.MultiheadAttention, layer.self_attn)
