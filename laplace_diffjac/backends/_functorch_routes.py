"""How ``DiffFuncGGN`` maps its per-sample function over a batch: ``vmap`` or a loop.

``vmap`` traces the model once for the whole batch, but it cannot trace every
model: a model that turns a tensor into a Python value (``.item()``, ``if
mask.all():``, as Hugging Face ``transformers`` does while it builds the attention
masks of BERT and of GPT-2's default ``sdpa`` attention) stops it with a
``RuntimeError``, and recurrent layers and cells cannot be batched at all. Such
models take the same per-sample function in a loop, each sample as a batch of one
under ``jacrev`` alone: the same results, only slower (by the Python overhead of
one call per sample).

The route is decided before any work on the batch: recurrent layers and cells
always loop; any other model is run forward on its first sample alone under
``vmap`` (one sample's forward pass, the only cost when ``vmap`` works). If that
raises, the model's state is put back and the batch goes through the loop, which
either gives the results or raises the model's own error, then without ``vmap`` in
the way. No warning is issued either way. A model whose forward pass ``vmap``
traces but whose backward pass it cannot is not detected (none is known).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.func import vmap

from ..jacobians._model_guard import preserved_state
from ..jacobians._rules_recurrent import SAMPLE_BY_SAMPLE

__all__ = ["map_over_samples", "runs_sample_by_sample", "vmap_traces"]

PerSampleResults = tuple[dict[str, torch.Tensor], torch.Tensor]


def map_over_samples(
    fn: Callable[..., tuple],
    forward: Callable[[dict[str, torch.Tensor], Any], torch.Tensor],
    params: dict[str, torch.Tensor],
    x: Any,
    per_sample: torch.Tensor | None,
    batch: int,
    model: nn.Module,
) -> PerSampleResults:
    """``vmap(fn)`` over the samples of ``x`` (and ``per_sample``), or a loop.

    Parameters
    ----------
    fn : callable
        ``fn(params, x_i, per_sample_i) -> (dict of tensors, tensor)`` for one
        sample ``x_i`` (a tensor ``(*input_shape)`` or a mapping of such).
    forward : callable
        ``forward(params, x_i)``: the model's output for one sample, which ``fn``
        differentiates; run on the first sample under ``vmap`` to choose the route.
    params : dict of torch.Tensor
        Passed to every call of ``fn`` unbatched.
    x : torch.Tensor or mapping
        Inputs ``(batch, *input_shape)``, or a mapping of such tensors.
    per_sample : torch.Tensor, optional
        A second per-sample argument ``(batch, ...)`` (targets, output indices).
    batch : int
        The number of samples.
    model : torch.nn.Module
        The model ``forward`` calls; its state is restored if ``vmap`` fails on it.

    Returns
    -------
    dict of torch.Tensor
        The first results of ``fn``, stacked over samples ``(batch, ...)``.
    torch.Tensor
        Its second results, stacked ``(batch, ...)``.

    """
    if runs_sample_by_sample(model):
        with _without_onednn():
            return _sample_loop(fn, params, x, per_sample, batch)
    if not vmap_traces(forward, params, x, model):
        return _sample_loop(fn, params, x, per_sample, batch)
    in_dims = (None, 0, None if per_sample is None else 0)
    return vmap(fn, in_dims=in_dims)(params, x, per_sample)


def vmap_traces(
    forward: Callable[[dict[str, torch.Tensor], Any], torch.Tensor],
    params: dict[str, torch.Tensor],
    x: Any,
    model: nn.Module,
) -> bool:
    """Whether ``vmap`` runs ``forward`` on the first sample of ``x`` without error.

    The forward pass runs with gradients enabled, as it does under ``jacrev``
    (modules such as ``nn.MultiheadAttention`` take other kernels without them).
    Only ``RuntimeError`` is caught: the class PyTorch raises for every failure of
    ``vmap`` (``.item()``, data-dependent control flow, in-place writes of batched
    into unbatched tensors), which has no subclass of its own. Whatever the
    forward pass had rebound or registered on the model before it failed is put
    back. A genuine error of the model is not lost: the loop that follows meets it
    again on the same sample and raises it.

    Returns
    -------
    bool

    """
    first = _rows(x, 0, 1)
    try:
        with preserved_state(model), torch.enable_grad():
            vmap(forward, in_dims=(None, 0))(params, first)
    except RuntimeError:
        return False
    return True


def runs_sample_by_sample(model: nn.Module) -> bool:
    """Whether ``model`` holds a recurrent layer or cell, which ``vmap`` cannot batch.

    Under ``vmap`` a cell creates its zero state unbatched and writes the batched
    result into it; the fused kernels of ``nn.RNN``/``nn.LSTM``/``nn.GRU`` have no
    batching rule.

    Returns
    -------
    bool

    """
    return any(isinstance(m, SAMPLE_BY_SAMPLE) for m in model.modules())


def _sample_loop(
    fn: Callable[..., tuple],
    params: dict[str, torch.Tensor],
    x: Any,
    per_sample: torch.Tensor | None,
    batch: int,
) -> PerSampleResults:
    """``vmap(fn)`` as a loop over samples, stacked the same way."""
    results = [
        fn(
            params,
            {k: v[i] for k, v in x.items()} if isinstance(x, Mapping) else x[i],
            None if per_sample is None else per_sample[i],
        )
        for i in range(batch)
    ]
    jac = {name: torch.stack([r[0][name] for r in results]) for name in params}
    return jac, torch.stack([r[1] for r in results])


@contextmanager
def _without_onednn() -> Iterator[None]:
    """Run recurrent layers on ATen's kernels, not oneDNN's, for this call only.

    oneDNN's ``mkldnn_rnn_layer`` (float32 on CPU) has no ``torch.func`` backward
    ("undefined Tensor ... 'workspace'"). ``torch.backends.mkldnn.flags`` would do
    the same but warns about TF32 on every use.

    Yields
    ------
    None

    """
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _rows(x: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of a tensor or of a mapping of tensors."""
    if isinstance(x, Mapping):
        return {k: v[start:stop] for k, v in x.items()}
    return x[start:stop]
