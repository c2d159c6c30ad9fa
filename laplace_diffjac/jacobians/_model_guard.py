"""Snapshot a model's Python-level state and put it back, whatever happens.

Running BackPACK means registering hooks and storing inputs, outputs and results as
attributes on modules and parameters. :func:`preserved_state` records what is there
before a computation and, on exit (also after an exception), removes every attribute
and hook that was added, puts back every attribute that was rebound or deleted, and
restores each parameter's ``.grad`` object. Tensor *values* are not copied: nothing in
this package writes into a tensor in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


class _ObjectSnapshot:
    """The attribute dictionary of one object, shallowly copied."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.attrs = dict(vars(obj))
        self.hook_keys = {
            name: set(d.keys())
            for name in _HOOK_DICTS
            if isinstance(d := self.attrs.get(name), dict)
        }

    def restore(self) -> None:
        current = vars(self.obj)
        for key in [k for k in current if k not in self.attrs]:
            del current[key]
        for key, value in self.attrs.items():
            if key not in current or current[key] is not value:
                current[key] = value
        for name, keys in self.hook_keys.items():
            hooks = current[name]
            for key in [k for k in hooks if k not in keys]:
                del hooks[key]


class _ParameterSnapshot:
    """A tensor's ``.grad`` and its extra Python attributes (e.g. ``grad_batch``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.grad = tensor.grad
        self.attrs = dict(vars(tensor))

    def restore(self) -> None:
        if self.tensor.grad is not self.grad:
            self.tensor.grad = self.grad
        current = vars(self.tensor)
        for key in [k for k in current if k not in self.attrs]:
            del current[key]
        for key, value in self.attrs.items():
            if key not in current or current[key] is not value:
                current[key] = value


@contextmanager
def preserved_state(*modules: nn.Module | None) -> Iterator[None]:
    """Restore the Python-level state of ``modules`` and their parameters on exit.

    Parameters
    ----------
    *modules : torch.nn.Module or None
        Modules whose submodules, parameters and buffers are protected. ``None``
        entries are ignored.

    Yields
    ------
    None

    """
    module_snaps: list[_ObjectSnapshot] = []
    tensor_snaps: list[_ParameterSnapshot] = []
    seen: set[int] = set()
    for root in modules:
        if root is None:
            continue
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            module_snaps.append(_ObjectSnapshot(module))
        for tensor in _tensors_of(root):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            tensor_snaps.append(_ParameterSnapshot(tensor))
    try:
        yield
    finally:
        for snap in module_snaps:
            snap.restore()
        for tensor_snap in tensor_snaps:
            tensor_snap.restore()


def _tensors_of(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()
