"""Per-sample Jacobian factors of ``nn.Embedding``: the signals scattered by token.

Row ``s`` of the table enters sample ``b`` at every position ``l`` with
``index[b, l] = s``, so its per-sample Jacobian is the sum of the signals at those
positions: a :class:`.Scattered` factor, written with one ``scatter_add_`` into the
final Jacobian. BackPACK's rule forms the one-hot product instead, whose cost grows
with the vocabulary (``B·V·L·K·S`` multiply-adds for a block of ``B·V·S·K``
entries). ``padding_idx`` follows PyTorch's autograd convention: the padding row is
not trained, its Jacobian is zero.
"""

from __future__ import annotations

from torch import nn

from ._assembly import Factors, Scattered
from ._layer_calls import LayerCall


def unsupported_reason(module: nn.Embedding) -> str | None:
    """Why the rule cannot handle ``module``, or ``None`` if it can."""
    if module.max_norm is not None:
        return "Embedding with max_norm (its forward renormalises rows in place)"
    if module.scale_grad_by_freq:
        return (
            "Embedding with scale_grad_by_freq (its gradient is rescaled by the "
            "batch's token counts, so it is not the per-sample derivative)"
        )
    return None


def embedding_factors(
    call: LayerCall, grads: tuple, wanted: set[int]
) -> list[tuple[int, Factors]]:
    """The factor of ``weight`` from signals ``(V, B, *, K)`` at the output.

    Parameters
    ----------
    call : LayerCall
        A call of an ``nn.Embedding`` with integer input ``(B, *)``.
    grads : tuple
        ``(signals,)``: ``(V, B, *, K)`` at the output, or ``None``.
    wanted : set of int
        ``id`` of the parameters of interest.

    Returns
    -------
    list of (int, Factors)
        One :class:`.Scattered` factor for ``weight``, if wanted and reached.

    """
    module: nn.Embedding = call.module  # type: ignore[assignment]
    g = grads[0]
    if g is None or id(module.weight) not in wanted:
        return []
    n_rows, batch = g.shape[:2]
    signals = g.reshape(n_rows, batch, -1, module.embedding_dim)  # (V, B, L, K)
    index = call.inputs[0].reshape(batch, -1)  # (B, L)
    if module.padding_idx is not None:
        trained = (index != module.padding_idx).to(signals.dtype)
        signals = signals * trained[None, :, :, None]
    return [(id(module.weight), Scattered(signals, index))]
