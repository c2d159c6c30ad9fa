"""Shared, seeded cases: architectures, batches and the laplace-torch version."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.laplace_integration._compat import LAPLACE_VERSION

# PyTorch warns once per process for some misuses (a scalar from a tensor that
# requires grad, say). Under pytest-xdist which test meets such a warning first
# depends on how tests fall to workers, so `-W error` would catch it in one run and
# not the next. Warning every time makes each test's outcome its own.
torch.set_warn_always(True)


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


# Models with attention, normalisation and recurrent layers; their
# inputs may be dict-like, and the recurrent ones need the looped reference.


class TinyTransformer(nn.Module):
    """Token embedding, one encoder layer (LayerNorm, attention), mean pool, head.

    Called with a mapping ``{"input_ids": (batch, T)}``, as Hugging Face models are.
    """

    def __init__(
        self, c: int = 3, vocab: int = 11, d: int = 8, heads: int = 2, ff: int = 16
    ):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoderLayer(
            d, heads, ff, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(d, c)

    def forward(self, batch):
        return self.head(self.enc(self.emb(batch["input_ids"])).mean(1))


class PaddedTransformer(TinyTransformer):
    """Token 0 pads, as in Hugging Face models: ``padding_idx`` of the embedding,
    ``key_padding_mask`` of the attention, a mean over the real tokens. The first
    token is never masked, so no row of the attention is empty."""

    def __init__(self, c: int = 2):
        super().__init__(c)
        self.emb = nn.Embedding(11, 8, padding_idx=0)

    def forward(self, batch):
        ids = batch["input_ids"]
        pad = (ids == 0) & (torch.arange(ids.shape[1]) > 0)
        h = self.enc(self.emb(ids), src_key_padding_mask=pad)
        real = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * real).sum(1) / real.sum(1))


class SequenceFirstEncoder(nn.Module):
    """Two encoder layers with PyTorch's default ``batch_first=False``, fed
    ``(T, batch, 4)`` with a padding mask: their Linear and LayerNorm layers see the
    sequence first."""

    def __init__(self, c: int = 2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(4, c)

    def forward(self, x):
        pad = (x[..., 0] > 1.0) & (torch.arange(x.shape[1]) > 0)
        return self.head(self.enc(x.transpose(0, 1), src_key_padding_mask=pad).mean(0))


class LSTMRegressor(nn.Module):
    """LSTM over a sequence, head on the last hidden state and the mean output."""

    def __init__(self, c: int = 1, rnn: type = nn.LSTM, **kwargs):
        super().__init__()
        self.rnn = rnn(3, 5, batch_first=True, **kwargs)
        h_width = kwargs.get("proj_size", 0) or 5
        dirs = 2 if self.rnn.bidirectional else 1
        self.head = nn.Linear(h_width * (1 + dirs), c)

    def forward(self, x):
        out, h = self.rnn(x)
        h = h[0] if isinstance(h, tuple) else h
        return self.head(torch.cat([h[-1], out.mean(1)], dim=1))


class SequenceFirstGRU(nn.Module):
    """A two-layer bidirectional GRU fed ``(T, batch, in)`` (batch_first=False)."""

    def __init__(self, c: int = 2):
        super().__init__()
        self.rnn = nn.GRU(3, 4, num_layers=2, bidirectional=True)
        self.head = nn.Linear(8, c)

    def forward(self, x):
        out, _ = self.rnn(x.transpose(0, 1))
        return self.head(torch.tanh(out[-1]))


class CrossAttention(nn.Module):
    """Sequence-first cross-attention with kdim/vdim, causal and padding masks."""

    def __init__(self, c: int = 2):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, kdim=6, vdim=5)
        self.head = nn.Linear(8, c)

    def forward(self, x):
        q = x.transpose(0, 1)  # (T, B, 8)
        k, v = torch.tanh(q[..., :6]), q[..., 2:7]
        steps = q.shape[0]
        causal = torch.ones(steps, steps, dtype=torch.bool).triu(1)
        padding = (x[..., 0] > 1.0) & (torch.arange(steps) > 0)
        out, _ = self.attn(q, k, v, key_padding_mask=padding, attn_mask=causal)
        return self.head(out.mean(0))


def _groupnorm_cnn(c: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.GroupNorm(2, 4),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, c),
    )


def _layernorm_mlp(c: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(3, 6), nn.LayerNorm(6), nn.Tanh(), nn.Flatten(), nn.Linear(24, c)
    )


@dataclass(frozen=True)
class SequenceCase:
    """A seeded float64 model with an input factory (tensor or dict of tokens)."""

    name: str
    make_model: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    tokens: int = 0  # vocabulary size for dict token inputs; 0 for float tensors
    loop_reference: bool = False  # plain autograd reference (see references.py)

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.make_model().double().eval()

    def inputs(self, batch: int = 3, seed: int = 1):
        gen = torch.Generator().manual_seed(seed)
        if self.tokens:
            ids = torch.randint(
                0, self.tokens, (batch, *self.input_shape), generator=gen
            )
            return {"input_ids": ids}
        return torch.randn(
            (batch, *self.input_shape), generator=gen, dtype=torch.float64
        )


SEQUENCE_CASES = [
    SequenceCase(
        "transformer-dict", TinyTransformer, (5,), tokens=11, loop_reference=True
    ),
    SequenceCase(
        "transformer-padding", PaddedTransformer, (6,), tokens=4, loop_reference=True
    ),
    SequenceCase(  # T = 3 = the default batch: a mixed-up layout would not fail
        "transformer-sequence-first",
        SequenceFirstEncoder,
        (3, 4),
        loop_reference=True,
    ),
    SequenceCase("lstm-regressor", LSTMRegressor, (4, 3), loop_reference=True),
    SequenceCase(
        "lstm-2layer-bidirectional-proj",
        lambda: LSTMRegressor(2, num_layers=2, bidirectional=True, proj_size=2),
        (4, 3),
        loop_reference=True,
    ),
    SequenceCase("gru-sequence-first", SequenceFirstGRU, (4, 3), loop_reference=True),
    SequenceCase(
        "rnn-relu",
        lambda: LSTMRegressor(2, nn.RNN, nonlinearity="relu"),
        (4, 3),
        loop_reference=True,
    ),
    SequenceCase("cross-attention-masks", CrossAttention, (4, 8), loop_reference=True),
    SequenceCase(
        "groupnorm-cnn", lambda: _groupnorm_cnn(3), (1, 6, 6), loop_reference=True
    ),
    SequenceCase(
        "layernorm-on-sequences",
        lambda: _layernorm_mlp(2),
        (4, 3),
        loop_reference=True,
    ),
]


@pytest.fixture
def assembled_widths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many parameters each Jacobian assembly writes, in call order.

    Wraps ``assemble`` wherever the engine, the factor Gram and the factor
    products call it, for the duration of the test.
    """
    from laplace_diffjac.jacobians import _assembly, _engine, _factor_products
    from laplace_diffjac.kernels import _factor_gram

    widths: list[int] = []

    def counting(factors, params, *args):
        widths.append(len(params))
        return _assembly.assemble(factors, params, *args)

    for module in (_engine, _factor_gram, _factor_products):
        monkeypatch.setattr(module, "assemble", counting)
    return widths


def _cores() -> int:
    """The cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (the README's ``-n 2``), each worker's torch computes on
    its share of the cores, so that the workers do not oversubscribe them."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, _cores() // int(workers)))
