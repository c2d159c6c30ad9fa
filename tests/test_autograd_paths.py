"""``reaches_leaf``: which tensors' graphs lead back to a leaf."""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac._autograd_paths import reaches_leaf


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
