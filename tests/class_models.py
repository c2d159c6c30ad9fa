"""Class models shared by the factor-route tests (kernels, the context posterior).

Residual and shared layers, a CNN, token inputs through attention, dict inputs and a
layer norm: what a model written as a class is made of, beyond ``nn.Sequential``.
Nothing here imports ``laplace_diffjac``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


class Residual(nn.Module):
    """A class MLP with a residual connection and a layer used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared, self.out = (
            nn.Linear(4, 6),
            nn.Linear(6, 6),
            nn.Linear(6, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + torch.tanh(self.shared(h))
        return self.out(torch.tanh(self.shared(h)))


class SmallCNN(nn.Module):
    """Conv2d, ReLU, max-pooling and a Linear head on 1×8×8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        return self.head(torch.tanh(self.conv2(h)).flatten(1))


class TokenTransformer(nn.Module):
    """Token and position embeddings, one encoder layer, mean-pooled Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(11, 8), nn.Embedding(5, 8)
        self.encoder = nn.TransformerEncoderLayer(
            8, 2, 12, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        h = self.tokens(x) + self.positions(positions)
        return self.head(self.encoder(h).mean(1))


class DictModel(nn.Module):
    """Two named inputs, as a ``BatchEncoding``-like batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 5), nn.Linear(2, 5), nn.Linear(5, 3)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.head(torch.tanh(self.a(batch["u"]) * self.b(batch["v"])))


class NormMLP(nn.Module):
    """Linear, LayerNorm (its scale and shift as the engine's own blocks), Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.out = (
            nn.Linear(4, 6),
            nn.LayerNorm(6),
            nn.Linear(6, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


class PlainBlock(nn.Module):
    """A ResNet ``BasicBlock`` without batch norm: two 3×3 convolutions, a 1×1
    shortcut where the stride is not 1, ``out += identity`` and in-place ReLUs."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.down = nn.Conv2d(c_in, c_out, 1, stride) if stride > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.conv2(self.relu(self.conv1(x)))
        out += identity
        return self.relu(out)


def _floats(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).double()


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 11, (n, 5), generator=torch.Generator().manual_seed(seed))


#: name -> (model class, inputs(n, seed)); every model has 3 outputs.
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, int], Any]]] = {
    "residual-shared": (Residual, lambda n, seed: _floats(seed, n, 4)),
    "cnn": (SmallCNN, lambda n, seed: _floats(seed, n, 1, 8, 8)),
    "token-transformer": (TokenTransformer, lambda n, seed: _tokens(n, seed + 1)),
    "dict-inputs": (
        DictModel,
        lambda n, seed: {"u": _floats(seed, n, 4), "v": _floats(seed + 1, n, 2)},
    ),
    "layer-norm": (NormMLP, lambda n, seed: _floats(seed, n, 4)),
}


def built(name: str, n: int, seed: int = 7) -> tuple[nn.Module, Any]:
    """The model ``name`` in float64 eval mode (seeded) and ``n`` of its inputs.

    Returns
    -------
    tuple
        ``(model, inputs)``.
    """
    make_model, make_x = MODELS[name]
    torch.manual_seed(0)
    return make_model().double().eval(), make_x(n, seed)
