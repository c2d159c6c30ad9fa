"""``reaches_leaf``: which tensors' graphs lead back to a leaf."""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac._autograd_paths import reaches_leaf, tracked, used_by_this_pass


def test_paths_through_the_graph_are_found_and_others_are_not() -> None:
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    from_x = (x * 2).sin()
    from_w = (w * 3).exp()
    mixed = from_w * from_x.sum()
    masked = torch.where(x.detach() > 0, w, 0.0)  # the mask carries no graph
    constant = torch.randn(3)
    found = reaches_leaf([from_x, from_w, mixed, masked, constant, x], x)
    assert found == [True, False, True, False, False, True]
    # the answers agree with autograd itself
    for t, reaches in zip([from_x, from_w, mixed, masked], found):
        (g,) = torch.autograd.grad(t.sum(), x, allow_unused=True, retain_graph=True)
        assert (g is not None) == reaches


def test_a_graph_deeper_than_the_recursion_limit() -> None:
    x = torch.randn(2, requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0001
    unrelated = torch.randn(2, requires_grad=True)
    z = unrelated
    for _ in range(5000):
        z = z + 1.0
    assert reaches_leaf([y, z], x) == [True, False]


def test_refuses_a_tensor_that_is_not_a_leaf_requiring_grad() -> None:
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        reaches_leaf([x * 2], x * 2)
    with pytest.raises(ValueError, match="leaf"):
        reaches_leaf([x * 2], torch.randn(2))


def test_a_backward_pass_says_which_tracked_gradients_it_uses() -> None:
    """Inside a custom backward: ``autograd.grad(y, x)`` uses ``x``'s gradient
    only; ``backward()`` uses all; ``backward(inputs=[w])`` uses ``w``'s."""
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    seen: list[list[bool]] = []

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):  # type: ignore[override]
            ctx.views = (a, b)
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            seen.append(used_by_this_pass(ctx.views))
            a, b = ctx.saved_tensors
            return g * b, g * a

    def output():
        return Product.apply(*tracked([x, w])).sum()

    torch.autograd.grad(output(), x)
    output().backward()
    output().backward(inputs=[w])
    torch.autograd.grad(output(), [x, w])
    assert seen == [[True, False], [True, True], [False, True], [True, True]]
    assert tracked([torch.ones(2)])[0].grad_fn is None  # no grad: itself


def test_without_the_engine_query_every_tracked_gradient_counts_as_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A PyTorch release without ``_will_engine_execute_node``: the gradients
    are computed, never lost (the budgeted Gram then does what it did before)."""
    monkeypatch.delattr(torch._C, "_will_engine_execute_node")
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    views = tracked([x, w, torch.ones(3)])
    assert used_by_this_pass(views) == [True, True, False]
