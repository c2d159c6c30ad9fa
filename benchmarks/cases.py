"""Benchmark configurations: seeded models and inputs, described by plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Config:
    """One model/batch configuration.

    Attributes
    ----------
    kind : {'mlp', 'cnn'}
        ``'mlp'``: ``depth`` hidden Tanh layers of ``width`` on ``d_in`` inputs;
        ``'cnn'``: two 3x3 convolutions with ReLU and max-pooling on 1x28x28, then
        a hidden layer of ``width``.
    width : int
        Hidden width.
    n_out : int
        Outputs C.
    batch : int
        Batch size B.
    depth : int
        Hidden layers of the MLP.
    d_in : int
        Input features of the MLP.
    """

    kind: str
    width: int
    n_out: int
    batch: int
    depth: int = 2
    d_in: int = 64

    @property
    def name(self) -> str:
        if self.kind == "cnn":
            return f"cnn-w{self.width}-C{self.n_out}-B{self.batch}"
        return f"mlp{self.depth}x{self.width}-C{self.n_out}-B{self.batch}"

    def to_dict(self) -> dict:
        return asdict(self)

    def input_shape(self) -> tuple[int, ...]:
        return (1, 28, 28) if self.kind == "cnn" else (self.d_in,)

    def model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """Seeded model in evaluation mode."""
        torch.manual_seed(0)
        if self.kind == "cnn":
            net = nn.Sequential(
                nn.Conv2d(1, 8, 3),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(8, 16, 3),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.Linear(16 * 5 * 5, self.width),
                nn.Tanh(),
                nn.Linear(self.width, self.n_out),
            )
        else:
            layers: list[nn.Module] = []
            fan_in = self.d_in
            for _ in range(self.depth):
                layers += [nn.Linear(fan_in, self.width), nn.Tanh()]
                fan_in = self.width
            layers.append(nn.Linear(fan_in, self.n_out))
            net = nn.Sequential(*layers)
        return net.to(dtype).eval()

    def inputs(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Seeded input batch ``(B, *input_shape)``."""
        gen = torch.Generator().manual_seed(1)
        return torch.randn((self.batch, *self.input_shape()), generator=gen).to(dtype)


#: Jacobian configurations of the full run (about 12 minutes on 2 cores).
FULL = [
    Config("mlp", 64, 1, 32),
    Config("mlp", 64, 10, 128),
    Config("mlp", 128, 10, 512),
    Config("mlp", 256, 1, 128),
    Config("mlp", 256, 10, 128),
    Config("mlp", 256, 100, 32),
    Config("mlp", 512, 10, 32),
    Config("mlp", 512, 10, 128),
    Config("cnn", 64, 10, 32),
    Config("cnn", 64, 10, 128),
]

#: Smoke-size configurations for ``--quick`` (the test of the harness).
QUICK = [
    Config("mlp", 16, 3, 8, d_in=8),
    Config("cnn", 8, 2, 2),
]

#: Gram configurations and whether the J route (B·C·P floats of J, (B·C)²·P flops)
#: is affordable there; the structured and kernel routes run everywhere.
GRAM_FULL = [
    (Config("mlp", 512, 1, 256), True),
    (Config("mlp", 512, 10, 64), True),
    (Config("mlp", 512, 10, 256), False),
    (Config("mlp", 128, 10, 64), True),
    (Config("mlp", 128, 10, 256), False),
    (Config("mlp", 512, 10, 64, depth=4), False),
]

GRAM_QUICK = [(Config("mlp", 16, 3, 8, d_in=8), True)]
