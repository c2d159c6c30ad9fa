"""``held_bytes`` counts outputs and what their graph saved, each storage once."""

from __future__ import annotations

import torch

from laplace_diffjac.kernels._held_memory import held_bytes


def test_an_output_without_graph_counts_its_own_storage():
    t = torch.zeros(1000, dtype=torch.float64)
    assert held_bytes([t]) == 8000
    assert held_bytes([t, t[:10]]) == 8000  # a view shares the storage


def test_saved_tensors_count_and_inputs_are_left_out():
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    y = x.exp()  # exp saves its result: y
    assert held_bytes([y], exclude=[x]) == 8000
    z = (x * 2).sin()  # sin saves its input, x * 2
    assert 16000 <= held_bytes([z], exclude=[x]) <= 16016  # and the 0-d scalar 2
    w = torch.randn(1000, 1000, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    out = w @ v  # mv saves both operands, both excluded
    assert held_bytes([out], exclude=[w, v]) == 8000
    assert held_bytes([out], exclude=[v]) == 8000 + 8 * 10**6


def test_a_custom_functions_saved_tensors_count():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            b = a * 3
            ctx.save_for_backward(b)
            return a * a

        @staticmethod
        def backward(ctx, grad):
            (b,) = ctx.saved_tensors
            return grad * b

    x = torch.randn(500, dtype=torch.float64, requires_grad=True)
    out = Square.apply(x)
    assert held_bytes([out], exclude=[x]) == 8000  # out and b


def test_freed_graphs_count_their_outputs_only():
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    y = (x * 2).sin()
    y.sum().backward(inputs=[x])
    assert held_bytes([y], exclude=[x]) == 8000
