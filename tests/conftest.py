"""Shared, seeded cases: architectures, batches and the laplace-torch version."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.laplace_integration._compat import LAPLACE_VERSION


@dataclass(frozen=True)
class Case:
    """A model factory with an input factory, both seeded and float64."""

    name: str
    make_model: Callable[[int], nn.Module]
    input_shape: tuple[int, ...]
    n_outputs: int

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.make_model(self.n_outputs).double().eval()

    def inputs(self, batch: int = 4, seed: int = 1) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(
            (batch, *self.input_shape), generator=gen, dtype=torch.float64
        )


def _mlp(c: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 5), nn.Sigmoid(), nn.Linear(5, c)
    )


def _cnn(c: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 2, 3),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * 2 * 2, c),
    )


def _bn_dropout(c: int) -> nn.Module:
    net = nn.Sequential(
        nn.Linear(3, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Dropout(0.3),
        nn.Linear(6, c),
    )
    with torch.no_grad():  # non-trivial running statistics
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 1.5)
    return net


CASES = [
    Case("mlp-C1", _mlp, (3,), 1),
    Case("mlp-C3", _mlp, (3,), 3),
    Case("cnn-C3", _cnn, (1, 6, 6), 3),
    Case("bn-dropout-C2", _bn_dropout, (3,), 2),
]

BACKENDS = [DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN]

ON_LAPLACE_03 = LAPLACE_VERSION >= (0, 3)


@pytest.fixture(params=CASES, ids=lambda c: c.name)
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


@pytest.fixture(params=BACKENDS, ids=lambda b: b.__name__)
def backend_cls(request: pytest.FixtureRequest) -> type:
    return request.param
