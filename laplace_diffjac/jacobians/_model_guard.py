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
from dataclasses import dataclass
from itertools import chain
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


class _StateSnapshot:
    """Every object's attributes, the modules' hook keys, the tensors' ``.grad``.

    Taken for all objects at once, and compared at once on restore: the keys
    of every attribute dictionary in order with the identities of their
    values, the hook dictionaries' lengths (and keys where there are any) and
    the ``.grad`` objects, each in one pass in C. Only when something differs
    is every object put back on its own.
    """

    def __init__(self, modules: list[nn.Module], tensors: list[torch.Tensor]) -> None:
        self.objects: list[Any] = [*modules, *tensors]
        self.saved = [vars(o).copy() for o in self.objects]  # keeps the values alive
        self.fingerprint = _fingerprint(self.objects)
        self.hooks = [
            hooks
            for module in modules
            for hooks in map(vars(module).get, _HOOK_DICTS)
            if isinstance(hooks, dict)
        ]
        self.lengths = [*map(len, self.hooks)]
        self.keys = {i: tuple(hooks) for i, hooks in enumerate(self.hooks) if hooks}
        self.tensors = tensors
        self.grads = [t.grad for t in tensors]

    def unchanged(self) -> bool:
        """Whether nothing was added, rebound, deleted or registered."""
        return (
            _fingerprint(self.objects) == self.fingerprint
            and [*map(len, self.hooks)] == self.lengths
            and all(tuple(self.hooks[i]) == keys for i, keys in self.keys.items())
            and all(t.grad is g for t, g in zip(self.tensors, self.grads))
        )

    def restore(self) -> None:
        """Put every attribute, hook dictionary and ``.grad`` back."""
        if self.unchanged():
            return
        for obj, saved in zip(self.objects, self.saved):
            current = vars(obj)
            for key in [k for k in current if k not in saved]:
                del current[key]
            for key, value in saved.items():
                if key not in current or current[key] is not value:
                    current[key] = value
        for i, hooks in enumerate(self.hooks):  # the saved dictionaries, put back
            kept = self.keys.get(i, ())
            for key in [k for k in hooks if k not in kept]:
                del hooks[key]
        for tensor, grad in zip(self.tensors, self.grads):
            if tensor.grad is not grad:
                tensor.grad = grad


def _fingerprint(objects: list[Any]) -> tuple[list[str], list[int]]:
    """The attribute names of ``objects`` in order and their values' identities."""
    held = [vars(o) for o in objects]
    return [*chain.from_iterable(held)], [
        *map(id, chain.from_iterable(map(dict.values, held)))
    ]


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
    walked: list[nn.Module] = []
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for root in modules:
        if root is None:
            continue
        for module in root.modules():  # one walk: each module's own tensors
            if id(module) in seen:
                continue
            seen.add(id(module))
            walked.append(module)
            for tensor in _tensors_of(module):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    tensors.append(tensor)
    snapshot = _StateSnapshot(walked, tensors)
    try:
        yield
    finally:
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
        :func:`runs_only_torch_modules` of ``model`` (:attr:`ModelSurvey.plain`).

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
    return survey(model).plain


@dataclass(frozen=True)
class ModelSurvey:
    """What one walk of a model tells about the code a call of it may run.

    Attributes
    ----------
    hook_free : bool
        No module holds a forward or backward hook and no process-wide module
        hook is registered (``False`` where this torch does not say).
    torch_only : bool
        Every module's class is defined in ``torch.nn.modules``.
    """

    hook_free: bool
    torch_only: bool

    @property
    def plain(self) -> bool:
        """Only torch.nn's own code, writing nothing, can run."""
        return self.hook_free and self.torch_only


def survey(model: nn.Module) -> ModelSurvey:
    """Walk ``model`` once for :class:`ModelSurvey`.

    Returns
    -------
    ModelSurvey
    """
    global_hooks = getattr(_torch_module, "_has_any_global_hook", None)
    hook_free = global_hooks is not None and not global_hooks()
    torch_only = True
    for module in model.modules():
        if torch_only and not is_torch_nn_module(module):
            torch_only = False
        held = vars(module)  # the dictionaries torch's own call checks
        if hook_free and (
            held.get("_forward_hooks")
            or held.get("_forward_pre_hooks")
            or held.get("_backward_hooks")
            or held.get("_backward_pre_hooks")
        ):
            hook_free = False
        if not (hook_free or torch_only):
            break
    return ModelSurvey(hook_free, torch_only)


def is_torch_nn_module(module: nn.Module) -> bool:
    """Whether ``module``'s class is one of torch.nn's own (not a subclass's).

    Returns
    -------
    bool
        ``True`` where the class is defined in ``torch.nn.modules``.
    """
    return type(module).__module__.startswith("torch.nn.modules.")
