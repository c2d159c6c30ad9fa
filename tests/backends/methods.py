"""Every public method of a backend that runs a backward pass, as a uniform call."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN


def method_calls(backend_cls: type) -> dict[str, Callable]:
    """Map method name -> call(backend, x, y) for what ``backend_cls`` offers."""
    calls: dict[str, Callable] = {
        "jacobians": lambda b, x, y: b.jacobians(x, enable_backprop=True),
        "jacobians-detached": lambda b, x, y: b.jacobians(x),
        "selected_output_jacobians": lambda b, x, y: b.selected_output_jacobians(
            x, torch.zeros(len(y), dtype=torch.long), enable_backprop=True
        ),
        "full": lambda b, x, y: b.full(x, y),
        "diag": lambda b, x, y: b.diag(x, y),
    }
    if backend_cls is DiffBackPackGGN:
        calls["kron"] = lambda b, x, y: b.kron(x, y, N=2 * len(y))
    if backend_cls in (DiffBackPackEF, DiffBackPackGGN):
        calls["gradients"] = lambda b, x, y: b.gradients(x, y)
    assert backend_cls in (DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN)
    return calls


def kron_friendly_mlp(n_out: int = 3) -> nn.Module:
    """An MLP whose modules every BackPACK extension supports."""
    torch.manual_seed(0)
    return (
        nn.Sequential(
            nn.Linear(3, 5),
            nn.Tanh(),
            nn.Linear(5, 4),
            nn.Sigmoid(),
            nn.Linear(4, n_out),
        )
        .double()
        .eval()
    )
