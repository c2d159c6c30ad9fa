"""Step 1 of the engine: the model's forward pass with its module calls recorded.

Two things a downloaded model does make a recorded call unusable as it stands,
and both are seen only once the model has run; the forward is then run again with
those modules' calls adjusted (:func:`.recorded_calls`):

* It writes in place into a recorded input or output after the call
  (``nn.ReLU(inplace=True)`` after batch norm, ``out += identity``): the tensors
  are copied around those calls, so that the recorded ones stay as the module
  saw and returned them (``_in_place``).
* A module is called on a tensor shared by the whole batch and its output is
  broadcast (BERT's position embeddings of position ids ``(1, T)``, added to
  token embeddings ``(B, T, D)``): the autograd signal at such an output is the
  sum over the batch, so the per-sample ones are lost. Its inputs (and output)
  that lead with 1 are expanded to the batch, so that it returns one copy per
  sample and its signals are the per-sample ones; the per-sample Jacobians of a
  shared input are those of every sample's own copy. The model's output must
  come out the same, or the module is refused.

Every run starts from the random generators' state before the first, so that
dropout in training mode draws the same masks in each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import UnsupportedModuleError
from ._derivatives import FORWARDS, shared_by_batch
from ._in_place import tensors_in
from ._layer_calls import LayerCall, recorded_calls
from ._model_guard import is_torch_nn_module
from ._sequence_first import batch_first_encoders


def recorded_forward(
    model: nn.Module,
    x: torch.Tensor | Mapping,
    modules: Sequence[nn.Module],
    rewritten: Sequence[nn.Module],
    batch: int,
) -> tuple[list[LayerCall], Any]:
    """``model(x)`` with the calls of ``modules`` recorded, run again where needed.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    x : torch.Tensor or Mapping
        Its input batch.
    modules : sequence of torch.nn.Module
        Modules whose calls are recorded (owners of the wanted parameters).
    rewritten : sequence of torch.nn.Module
        Further modules run in their elementary form (``_elementary``).
    batch : int
        Samples in ``x``.

    Returns
    -------
    calls : list of LayerCall
        In call order.
    f : object
        The model's output.

    Raises
    ------
    UnsupportedModuleError
        If a recorded tensor is still written into in place with the copies (the
        model holds on to a module's output by other means than its return), or
        the model's output changes with the copies or when a shared module's
        output is expanded to the batch.

    """
    attends = may_attend(model)
    copied: set[int] = set()
    expanded: set[int] = set()
    first: Any = None
    random_state = _RandomState()  # a rerun draws what the first run drew
    while True:  # each further run copies or expands more modules: it ends
        if first is not None:
            random_state.restore()
        recording = recorded_calls(
            modules, FORWARDS, rewritten, copied, expanded, batch
        )
        with recording as calls, batch_first_encoders(model):
            # the composite attention kernel: batched and double backward work
            with sdpa_kernel([SDPBackend.MATH]) if attends else nullcontext():
                f = model(x)
        first = f if first is None else first
        written = {id(c.module) for c in calls if c.modified_in_place()}
        if written & copied:
            raise UnsupportedModuleError(
                f"The model writes in place into the input or output of "
                f"{_names(model, written & copied)} after the call, even when "
                "given copies (it holds on to them by other means than the "
                "module's return), so their per-sample Jacobians cannot be read "
                "off; make that operation out of place or use "
                "laplace_diffjac.DiffFuncGGN."
            )
        shared = {id(c.module) for c in calls if shared_by_batch(c, batch)}
        if not written and not shared - expanded:
            break
        copied |= written
        expanded |= shared
    if (copied or expanded) and not _same_output(f, first):
        if expanded:
            raise UnsupportedModuleError(
                f"The output of {_names(model, expanded)} is shared by the batch "
                "(its first dimension is 1), and expanded to one copy per sample "
                "it changes the model's output, so the model uses it other than by "
                "broadcasting it over the batch. Expand its input to the batch "
                "yourself, or use laplace_diffjac.DiffFuncGGN."
            )
        raise UnsupportedModuleError(
            f"The model writes in place into the input or output of "
            f"{_names(model, copied)} after the call, and with copies of them its "
            "output changes (it reads them by other means than the module's "
            "return); make that operation out of place or use "
            "laplace_diffjac.DiffFuncGGN."
        )
    return calls, f


def may_attend(model: nn.Module) -> bool:
    """Whether ``model``'s forward may call ``scaled_dot_product_attention``.

    torch.nn's own modules call it only through ``MultiheadAttention`` (which
    the transformer layers hold); a module of any other type may call it
    itself. Choosing the attention kernel costs as much as a small layer's
    forward, so a model of torch.nn's other modules runs without it.

    Returns
    -------
    bool
    """
    return any(
        isinstance(m, nn.MultiheadAttention) or not is_torch_nn_module(m)
        for m in model.modules()
    )


class _RandomState:
    """The generators' state before the first run, to start every run from it.

    So that a model in training mode with dropout draws the same masks in a
    rerun, and the runs can be compared.
    """

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = (
            torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def _names(model: nn.Module, ids: set[int]) -> list[str]:
    return [n or "<root>" for n, m in model.named_modules() if id(m) in ids]


def _same_output(f: object, first: object) -> bool:
    """Whether two runs of the model gave the same output, up to rounding."""
    now, before = list(tensors_in(f)), list(tensors_in(first))
    if len(now) != len(before):
        return False
    for a, b in zip(now, before):
        if a.shape != b.shape:
            return False
        if a.is_floating_point():
            eps = torch.finfo(a.dtype).eps
            scale = float(b.detach().abs().max()) if b.numel() else 0.0
            if not torch.allclose(a, b, rtol=1e3 * eps, atol=1e3 * eps * scale):
                return False
        elif not torch.equal(a, b):
            return False
    return True
