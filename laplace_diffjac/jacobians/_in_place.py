"""In-place operations of a model's forward pass, kept from spoiling one call.

Downloaded models write into tensors in place: ``nn.ReLU(inplace=True)`` after a
convolution and batch norm, ``out += identity`` at the end of a residual block
(torchvision's ``BasicBlock``, ``Bottleneck``, ``InvertedResidual``). Two things
go wrong without care:

* The engine records each parameterised module's output as the tensor its signals
  are sent to. An in-place write after the call rebinds that tensor's autograd
  history to the write, so the signals would be taken after the activation (wrong
  Jacobians, silently). :meth:`.LayerCall.modified_in_place` compares the version
  counters of the recorded tensors with those seen at the call, and the engine
  then redoes the forward pass with those modules' inputs and outputs copied
  (``copied`` in :func:`.recorded_calls`): the model writes into the copies, the
  recorded tensors stay as they were, and the values the model computes are the
  same.
* A module run in an elementary form (``_elementary``) that works in place has
  already overwritten its input when the form is redone from it;
  :func:`.recorded_calls` keeps a copy of the input of such a module from before
  its call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn


def tensors_in(obj: object) -> Iterator[torch.Tensor]:
    """The tensors of a (nested tuple, list or mapping) argument, depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from tensors_in(item)


def versions(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """The version counters of ``tensors`` (bumped by every in-place write)."""
    return tuple(t._version for t in tensors)


def copied(obj: object) -> object:
    """``obj`` with every floating tensor in it (nested tuples, lists) cloned.

    Returns
    -------
    object
        Of the same structure; integer tensors and other values are shared.

    """
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(copied(item) for item in obj)
    if isinstance(obj, list):
        return [copied(item) for item in obj]
    return obj


def works_in_place(module: nn.Module) -> bool:
    """Whether ``module`` has an ``inplace`` flag and it is set."""
    return getattr(module, "inplace", None) is True
