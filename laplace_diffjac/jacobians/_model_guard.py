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


class _AttributeSnapshot:
    """The attribute dictionary of one object, shallowly copied.

    Restoring compares first the keys in order and the values' identities, in
    C; only a dictionary that changed is walked key by key.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.attrs = vars(obj).copy()
        self.keys = tuple(self.attrs)
        self.ids = [id(v) for v in self.attrs.values()]  # alive: ``attrs`` holds them

    def restore(self) -> None:
        current = vars(self.obj)
        if tuple(current) == self.keys and [*map(id, current.values())] == self.ids:
            return
        for key in [k for k in current if k not in self.attrs]:
            del current[key]
        for key, value in self.attrs.items():
            if key not in current or current[key] is not value:
                current[key] = value


class _ModuleSnapshot(_AttributeSnapshot):
    """A module's attributes and the keys of its hook dictionaries."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.hook_keys = [
            (name, frozenset(d))
            for name in _HOOK_DICTS
            if isinstance(d := self.attrs.get(name), dict)
        ]

    def restore(self) -> None:
        super().restore()
        current = vars(self.obj)
        for name, keys in self.hook_keys:
            hooks = current[name]
            if len(hooks) != len(keys) or hooks.keys() != keys:
                for key in [k for k in hooks if k not in keys]:
                    del hooks[key]


class _TensorSnapshot(_AttributeSnapshot):
    """A tensor's ``.grad`` and its extra Python attributes (e.g. ``grad_batch``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor)
        self.grad = tensor.grad

    def restore(self) -> None:
        if self.obj.grad is not self.grad:
            self.obj.grad = self.grad
        super().restore()


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
    snapshots: list[_AttributeSnapshot] = []
    seen: set[int] = set()
    for root in modules:
        if root is None:
            continue
        for module in root.modules():  # one walk: each module's own tensors
            if id(module) in seen:
                continue
            seen.add(id(module))
            snapshots.append(_ModuleSnapshot(module))
            for tensor in _tensors_of(module):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    snapshots.append(_TensorSnapshot(tensor))
    try:
        yield
    finally:
        for snapshot in snapshots:
            snapshot.restore()


def _tensors_of(module: nn.Module) -> Iterable[torch.Tensor]:
    """The module's own parameters and buffers (not its submodules').

    Read from its registries directly: ``parameters(recurse=False)`` walks the
    same entries through three generators, which costs more than the snapshot.

    Yields
    ------
    torch.Tensor
        Each registered parameter, then each buffer (``None`` entries skipped).
    """
    for registry in (module._parameters, module._buffers):
        for tensor in registry.values():
            if tensor is not None:
                yield tensor
