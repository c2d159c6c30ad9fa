"""Benchmark configurations: seeded models and inputs, described by plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Union

import torch
from torch import nn


@dataclass(frozen=True)
class Config:
    """One model/batch configuration.

    Attributes
    ----------
    kind : {'mlp', 'cnn', 'transformer'}
        ``'mlp'``: ``depth`` hidden Tanh layers of ``width`` on ``d_in`` inputs;
        ``'cnn'``: two 3x3 convolutions with ReLU and max-pooling on 1x28x28, then
        a hidden layer of ``width``; ``'transformer'``: token embedding (vocabulary
        ``d_in``, width ``width``), ``depth`` encoder layers (``heads`` heads,
        feed-forward ``ff``, LayerNorm), mean pool and a Linear head, called with
        ``{"input_ids": (B, seq)}``.
    width : int
        Hidden width (``d_model`` of the transformer).
    n_out : int
        Outputs C.
    batch : int
        Batch size B.
    depth : int
        Hidden layers of the MLP.
    d_in : int
        Input features of the MLP; vocabulary of the transformer.
    seq : int
        Sequence length of the transformer.
    heads : int
        Attention heads of the transformer.
    ff : int
        Feed-forward width of the transformer.
    """

    kind: str
    width: int
    n_out: int
    batch: int
    depth: int = 2
    d_in: int = 64
    seq: int = 0
    heads: int = 4
    ff: int = 64

    @property
    def name(self) -> str:
        if self.kind == "transformer":
            return (
                f"transformer-v{self.d_in}-d{self.width}-T{self.seq}"
                f"-C{self.n_out}-B{self.batch}"
            )
        if self.kind == "cnn":
            return f"cnn-w{self.width}-C{self.n_out}-B{self.batch}"
        return f"mlp{self.depth}x{self.width}-C{self.n_out}-B{self.batch}"

    def to_dict(self) -> dict:
        return asdict(self)

    def input_shape(self) -> tuple[int, ...]:
        if self.kind == "transformer":
            return (self.seq,)
        return (1, 28, 28) if self.kind == "cnn" else (self.d_in,)

    def model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """Seeded model in evaluation mode."""
        torch.manual_seed(0)
        if self.kind == "transformer":
            net: nn.Module = TokenTransformer(self)
        elif self.kind == "cnn":
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

    def inputs(self, dtype: torch.dtype = torch.float32) -> Batch:
        """Seeded input batch ``(B, *input_shape)`` (token ids in a dict)."""
        gen = torch.Generator().manual_seed(1)
        shape = (self.batch, *self.input_shape())
        if self.kind == "transformer":
            return {"input_ids": torch.randint(0, self.d_in, shape, generator=gen)}
        return torch.randn(shape, generator=gen).to(dtype)


Batch = Union[torch.Tensor, dict[str, torch.Tensor]]


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """``batch`` (a tensor, or a dict of token tensors) on ``device``."""
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return batch.to(device)


class TokenTransformer(nn.Module):
    """Embedding, encoder layers, mean pool, Linear head; takes a token dict."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.emb = nn.Embedding(cfg.d_in, cfg.width)
        self.layers = nn.Sequential(
            *(
                nn.TransformerEncoderLayer(
                    cfg.width, cfg.heads, cfg.ff, dropout=0.0, batch_first=True
                )
                for _ in range(cfg.depth)
            )
        )
        self.head = nn.Linear(cfg.width, cfg.n_out)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.layers(self.emb(batch["input_ids"])).mean(1))


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
    Config("transformer", 32, 10, 64, depth=1, d_in=100, seq=32, heads=4, ff=64),
    Config("transformer", 32, 10, 64, depth=1, d_in=1000, seq=32, heads=4, ff=64),
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
