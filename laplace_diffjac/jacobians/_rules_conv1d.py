"""Per-sample Jacobian factors of Hugging Face's ``Conv1D``: a transposed Linear.

GPT-2's projections are ``transformers.pytorch_utils.Conv1D``: ``x @ W + b`` with
the weight stored ``(in, out)``. Its weight block of sample ``b`` is
``Σ_t a[b, t] ⊗ g[v, b, t]`` in the column order ``(in, out)``, a
:class:`.TransposedProduct`, and its bias block ``Σ_t g[v, b, t]``: the closed
forms of ``nn.Linear``, so that Grams, Jacobian-vector products and Kronecker
factors contract them instead of a block computed by the local rule.

The type is looked up in ``sys.modules``, never imported: a model holding a
``Conv1D`` has imported ``transformers`` already, and a process that has not pays
nothing for the check.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ._assembly import Factors, Summed, TransposedProduct
from ._layer_calls import LayerCall
from ._rules_conv import batch_first


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is exactly ``transformers.pytorch_utils.Conv1D``.

    Returns
    -------
    bool
        ``False`` for subclasses, whose ``forward`` may differ.

    """
    loaded = sys.modules.get("transformers.pytorch_utils")
    kind = getattr(loaded, "Conv1D", None)
    return kind is not None and type(module) is kind


def conv1d_factors(
    call: LayerCall, grads: tuple[torch.Tensor | None, ...], wanted: set[int]
) -> list[tuple[int, Factors]]:
    """Factors of the weight ``(in, out)`` and the bias from signals at the output.

    Parameters
    ----------
    call : LayerCall
        A call of a ``Conv1D`` on inputs ``(B, *, in)``.
    grads : tuple
        ``(signals,)``: ``(V, B, *, out)`` at the output, or ``None``.
    wanted : set of int
        ``id`` of the parameters of interest.

    Returns
    -------
    list of (int, Factors)
        A :class:`.TransposedProduct` for the weight, a :class:`.Summed` factor
        for the bias, each if wanted and reached.

    """
    module = call.module
    grad = grads[0]
    if grad is None:
        return []
    n_rows, batch = grad.shape[0], grad.shape[1]
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    n_in, n_out = weight.shape
    g = grad.reshape(n_rows, batch, -1, n_out).transpose(2, 3)  # (V, B, out, T)
    blocks: list[tuple[int, Factors]] = []
    if id(weight) in wanted:
        a = call.inputs[0].reshape(batch, -1, n_in)  # (B, T, in)
        blocks.append((id(weight), TransposedProduct(batch_first(g), a)))
    if module.bias is not None and id(module.bias) in wanted:
        blocks.append((id(module.bias), Summed(g)))
    return blocks
