"""Bytes that tensors and the autograd graph behind them hold, counted on the graph.

The memory budget (:mod:`laplace_diffjac.budget`) needs, before the real work, the
memory one chunk of it holds: its results and, for a gradient, every tensor its
graph saved for the backward pass. Allocator statistics exist on CUDA only, and
saved-tensor hooks are refused inside ``torch.func`` transforms (which the engine
uses), so this module walks the graph instead: each node's ``_saved_*`` tensors,
each storage counted once, the inputs and parameters (memory the caller holds
anyway) left out. The count is the same on every device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["held_bytes"]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def held_bytes(
    outputs: Iterable[torch.Tensor], exclude: Iterable[torch.Tensor] = ()
) -> int:
    """Bytes of ``outputs`` and of the tensors their autograd graph saved.

    Parameters
    ----------
    outputs : iterable of torch.Tensor
        Results of a computation, with or without a graph.
    exclude : iterable of torch.Tensor
        Tensors whose storage is not counted (the inputs and the parameters).

    Returns
    -------
    int
        The bytes of every distinct storage among the outputs and the graph's
        saved tensors, the excluded ones aside.

    """
    seen = {_storage_key(t) for t in exclude}
    total = 0

    def count(t: torch.Tensor) -> None:
        nonlocal total
        if t.layout != torch.strided or t.device.type == "meta":
            return
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    nodes = []
    for t in outputs:
        count(t)
        if t.grad_fn is not None:
            nodes.append(t.grad_fn)
    for node in _graph_nodes(nodes):
        for name in dir(node):
            if name.startswith("_saved_") or name == "saved_tensors":
                for value in _saved_values(node, name):
                    count(value)
    return total


def _graph_nodes(roots: list) -> list:
    """Every node of the autograd graph reachable from ``roots``, once each."""
    found: dict[int, object] = {}
    while roots:
        node = roots.pop()
        if id(node) in found:
            continue
        found[id(node)] = node
        roots.extend(n for n, _ in node.next_functions if n is not None)
    return list(found.values())


def _saved_values(node: object, name: str) -> list[torch.Tensor]:
    """The tensors a graph node saved under ``name`` (none once they are freed)."""
    try:
        value = getattr(node, name)
    except RuntimeError:  # freed by an earlier backward pass
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []
