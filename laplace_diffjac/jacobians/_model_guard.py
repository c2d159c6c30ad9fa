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
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

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
        self.ids = [*map(id, self.attrs.values())]  # alive: ``attrs`` holds them

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
    """A module's attributes and the keys of its hook dictionaries.

    The hook dictionaries themselves are held (a replaced one is put back by
    the attributes' restore), each with its keys in order: most are empty, so
    a snapshot and the check that nothing was added cost a length each.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        held = map(self.attrs.get, _HOOK_DICTS)
        self.hooks = [(d, tuple(d)) for d in held if isinstance(d, dict)]

    def restore(self) -> None:
        super().restore()
        for hooks, keys in self.hooks:
            if len(hooks) == len(keys) and (not keys or tuple(hooks) == keys):
                continue
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


def guarded(model: nn.Module, plain: bool) -> AbstractContextManager[None]:
    """:func:`preserved_state` of ``model``, unless only torch's own code will run.

    The snapshot costs more than a small model's forward pass. The engine
    removes what it installs itself (its hooks, in ``finally``), so the guard is
    there for code the package does not control: hooks, process-wide module
    hooks, and the forward passes of modules that are not torch.nn's own
    (:func:`runs_only_torch_modules`). A model without any of them runs none.

    Parameters
    ----------
    model : torch.nn.Module
        The model about to be run forward and differentiated in its outputs.
    plain : bool
        :func:`runs_only_torch_modules` of ``model``.

    Returns
    -------
    contextlib.AbstractContextManager
        :func:`preserved_state` or a ``nullcontext``.
    """
    return nullcontext() if plain else preserved_state(model)


def runs_only_torch_modules(model: nn.Module) -> bool:
    """Whether ``model`` is made of torch.nn's own modules and no hook can fire.

    Every module's class is defined in ``torch.nn.modules`` (subclasses, models
    of other libraries and parametrised modules are not), no module holds a
    hook, and no process-wide module hook is registered. Their forward passes
    and the gradients of their outputs write no attribute and no ``.grad``.

    Returns
    -------
    bool
        ``False`` also where this torch does not say whether process-wide
        hooks exist.
    """
    global_hooks = getattr(_torch_module, "_has_any_global_hook", None)
    if global_hooks is None or global_hooks():
        return False
    for module in model.modules():
        if not type(module).__module__.startswith("torch.nn.modules."):
            return False
        held = vars(module)  # the dictionaries torch's own call checks
        if (
            held.get("_forward_hooks")
            or held.get("_forward_pre_hooks")
            or held.get("_backward_hooks")
            or held.get("_backward_pre_hooks")
        ):
            return False
    return True
