"""Which tensors of a graph lead back to a given leaf.

A gradient sent to a tensor whose graph never reaches the leaf adds nothing to
the leaf's gradient, so whoever computes that gradient by hand (the gradients of
the features first, then one backward pass to the inputs) can skip such tensors
before paying for their gradients. The signals of a network whose activations
are piecewise linear are such tensors for the inputs (``jacobians._piecewise_linear``):
they depend on the weights, not on the inputs.

A custom backward pass can also ask which of its inputs' gradients the current
pass will use (:func:`tracked` and :func:`used_by_this_pass`): ``ctx.needs_input_grad``
says only which inputs require grad, so a Gram's backward would otherwise pay
for the parameters' gradients when the caller asked for the inputs' alone
(``torch.autograd.grad(K, x)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["reaches_leaf", "tracked", "used_by_this_pass"]


def reaches_leaf(tensors: Sequence[torch.Tensor], leaf: torch.Tensor) -> list[bool]:
    """Whether each tensor's autograd graph leads back to ``leaf``.

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        Tensors computed from ``leaf`` (and other things).
    leaf : torch.Tensor
        A leaf that requires grad.

    Returns
    -------
    list of bool
        ``True`` where a path of the graph joins the tensor to ``leaf``: the
        structural dependence, which holds wherever the derivative may be
        nonzero. A tensor without a graph, or ``leaf`` itself, is ``False`` and
        ``True`` respectively.

    Raises
    ------
    ValueError
        If ``leaf`` is not a leaf that requires grad.

    """
    if not (leaf.is_leaf and leaf.requires_grad):
        raise ValueError("reaches_leaf needs a leaf tensor that requires grad.")
    # The leaf's gradient accumulator: the node a view of it leads to.
    with torch.enable_grad():  # also inside a backward pass, which runs without
        view = leaf.view_as(leaf)
    target = view.grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    known: dict[Any, bool] = {target: True}
    return [
        t is leaf or (t.grad_fn is not None and _reaches(t.grad_fn, known))
        for t in tensors
    ]


def _reaches(start: Any, known: dict[Any, bool]) -> bool:
    """Depth-first search from ``start`` with the answers in ``known`` kept.

    Iterative (the graphs of deep networks exceed Python's recursion limit): a
    node is settled once all its inputs are, ``True`` if any of them is.

    Returns
    -------
    bool
        Whether ``start`` leads to a node that ``known`` marks ``True``.
    """
    stack = [start]
    while stack:
        node = stack[-1]
        if node in known:
            stack.pop()
            continue
        pending = [
            child
            for child, _ in node.next_functions
            if child is not None and child not in known
        ]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        known[node] = any(
            known[child] for child, _ in node.next_functions if child is not None
        )
    return known[start]


def tracked(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor that requires grad as a view of itself: a node of its own.

    Passed to a custom ``torch.autograd.Function`` in place of the tensors, the
    views' nodes let its backward pass ask :func:`used_by_this_pass` whether the
    pass needs their gradients. The views share the tensors' storage.

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        E.g. a model's parameters.

    Returns
    -------
    list of torch.Tensor
        ``t.view_as(t)`` for each ``t`` that requires grad, else ``t`` itself.

    """
    return [t.view_as(t) if t.requires_grad else t for t in tensors]


def used_by_this_pass(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """During a backward pass: whether it will use each tracked tensor's gradient.

    ``torch.autograd.grad(out, inputs)`` and ``backward(inputs=...)`` run only
    the nodes that lead to their inputs; a plain ``backward()`` runs all.

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        Outputs of :func:`tracked` (non-leaf tensors; a leaf or a tensor without
        a graph counts as unused).

    Returns
    -------
    list of bool
        ``True`` where the running pass executes the tensor's node. Where
        PyTorch cannot tell (a release without the query), ``True`` for every
        tensor with a node: the gradient is computed, never lost.

    """
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    return [
        t.grad_fn is not None and (will_execute is None or will_execute(t.grad_fn))
        for t in tensors
    ]
