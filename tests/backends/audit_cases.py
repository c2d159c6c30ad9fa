"""One small float64 model per parameterised ``torch.nn`` module, for the audit.

Every case is ``layer -> tanh -> flatten -> Linear(·, OUTPUTS)``, so that the
module's parameters have non-trivial second derivatives and the model has
``OUTPUTS`` outputs, fewer than ``BATCH`` samples (``B != C``: a batching rule that
mixes the sample and output dimensions crashes or gives wrong numbers there).
Beside the ``torch.nn`` modules, the building blocks of downloaded models
(torchvision's, with in-place activations and residual additions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torchvision.models.mobilenetv3 import InvertedResidual, InvertedResidualConfig
from torchvision.models.resnet import BasicBlock, Bottleneck

BATCH = 5
OUTPUTS = 3


class AuditNet(nn.Module):
    """``head(tanh(run(layer, x)).flatten(1))``, counting its forward calls.

    ``forward_calls`` is a list, so that the count can change without changing the
    module's attributes as :func:`tests.references.model_state` sees them.
    """

    def __init__(
        self,
        layer: nn.Module,
        head_in: int,
        run: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.head = nn.Linear(head_in, OUTPUTS)
        self.run = run
        self.forward_calls = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_calls[0] += 1
        h = self.layer(x) if self.run is None else self.run(self.layer, x)
        return self.head(torch.tanh(h).flatten(1))


class _Scale(nn.Module):
    """A user module that holds a parameter of its own."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class HFConv1D(nn.Module):
    """Hugging Face's ``Conv1D`` (GPT-2): a Linear layer with weight ``(in, out)``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def _transformers_conv1d(nf: int, nx: int) -> nn.Module:
    """``transformers.pytorch_utils.Conv1D`` itself, with a bias that matters."""
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(nf, nx)
    with torch.no_grad():
        layer.bias.copy_(torch.linspace(-0.5, 0.5, nf))
    return layer


class _Patches(nn.Module):
    """ViT's patch embedding: a strided convolution, tokens ``(B, N, D)``."""

    def __init__(self, channels: int, width: int, patch: int) -> None:
        super().__init__()
        self.projection = nn.Conv2d(channels, width, patch, stride=patch)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projection(pixels).flatten(2).transpose(1, 2)


class ViTLikeEmbeddings(nn.Module):
    """Hugging Face's ``ViTEmbeddings``: it holds the class token and the position
    embeddings itself and adds them in its own forward."""

    def __init__(self, channels: int = 2, image: int = 4, patch: int = 2) -> None:
        super().__init__()
        width, tokens = 4, (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, width))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))  # unused here
        self.patch_embeddings = _Patches(channels, width, patch)
        self.position_embeddings = nn.Parameter(torch.randn(1, tokens + 1, width))
        self.dropout = nn.Dropout(0.0)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        embeddings = self.patch_embeddings(pixels)
        cls_tokens = self.cls_token.expand(pixels.shape[0], -1, -1)
        embeddings = torch.cat((cls_tokens, embeddings), dim=1)
        return self.dropout(embeddings + self.position_embeddings)


class HandRMSNorm(nn.Module):
    """The RMSNorm of LLaMA-style code, written out rather than ``nn.RMSNorm``."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class BertLikeEmbeddings(nn.Module):
    """Hugging Face's ``BertEmbeddings``: position ids ``(1, T)`` shared by the batch,
    their embeddings broadcast onto the tokens' (added in place), then LayerNorm."""

    def __init__(self, vocab: int = 7, positions: int = 4, width: int = 4) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, width, padding_idx=0)
        self.position_embeddings = nn.Embedding(positions, width)
        self.token_type_embeddings = nn.Embedding(2, width)
        self.LayerNorm = nn.LayerNorm(width)
        self.register_buffer(
            "position_ids", torch.arange(positions).expand((1, -1)), persistent=False
        )
        self.register_buffer(
            "token_type_ids", torch.zeros(1, positions, dtype=torch.long)
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, length = input_ids.shape
        position_ids = self.position_ids[:, :length]
        token_type_ids = self.token_type_ids[:, :length].expand(batch, length)
        embeddings = self.word_embeddings(input_ids)
        embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        embeddings += self.position_embeddings(position_ids)
        return self.LayerNorm(embeddings)


@dataclass(frozen=True)
class Case:
    """How to build one audited model and its input batch ``(BATCH, ...)``."""

    layer: Callable[[], nn.Module]
    head_in: int
    shape: tuple[int, ...]
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    tokens: int = 0  # > 0: integer inputs in [0, tokens)
    training: bool = False
    #: refused only once the model runs (what decides it is seen only then)
    refused_while_running: bool = False

    def model(self) -> AuditNet:
        torch.manual_seed(0)
        net = AuditNet(self.layer(), self.head_in, self.run).double()
        net.train(self.training)
        _randomise_running_stats(net)
        return net

    def inputs(self) -> torch.Tensor:
        torch.manual_seed(1)
        if self.tokens:
            return torch.randint(0, self.tokens, (BATCH, *self.shape))
        return torch.randn(BATCH, *self.shape, dtype=torch.float64)


def _randomise_running_stats(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            with torch.no_grad():
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)


def _first(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def _two_halves(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x[:, :2], x[:, 2:])


def _self_attention(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x, x, x, need_weights=False)[0]


def _with_memory(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x, x)


def _attention_weights(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out, weights = module(x, x, x, need_weights=True)
    return torch.cat([out.flatten(1), weights.flatten(1)], 1)


def _packed(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    lengths = torch.full((x.shape[0],), x.shape[1])
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
    return module(packed)[1][-1]


def _log_prob(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.log_prob(x)


def _after_linear(norm: nn.Module) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(4, 6), norm)


def _layer(d: int = 4) -> dict:
    return {"d_model": d, "nhead": 2, "dim_feedforward": 8, "dropout": 0.0}


CASES: dict[str, Case] = {
    "Linear": Case(lambda: nn.Linear(4, 6), 6, (4,)),
    "Bilinear": Case(lambda: nn.Bilinear(2, 2, 6), 6, (4,), _two_halves),
    "PReLU": Case(lambda: nn.Sequential(nn.Linear(4, 6), nn.PReLU()), 6, (4,)),
    "PReLU-channels": Case(
        lambda: nn.Sequential(nn.Conv1d(2, 3, 3), nn.PReLU(3)), 12, (2, 6)
    ),
    "Conv1d": Case(lambda: nn.Conv1d(2, 3, 3, padding=1), 18, (2, 6)),
    "Conv2d": Case(lambda: nn.Conv2d(2, 3, 3), 27, (2, 5, 5)),
    "Conv2d-groups-reflect": Case(
        lambda: nn.Conv2d(2, 4, 3, groups=2, padding=1, padding_mode="reflect"),
        64,
        (2, 4, 4),
    ),
    "Conv2d-replicate": Case(
        lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="replicate"), 27, (2, 3, 3)
    ),
    "Conv1d-circular-same": Case(
        lambda: nn.Conv1d(2, 3, 3, padding="same", padding_mode="circular"),
        18,
        (2, 6),
    ),
    "Conv3d": Case(lambda: nn.Conv3d(1, 2, 2), 16, (1, 3, 3, 3)),
    "Conv3d-circular": Case(
        lambda: nn.Conv3d(1, 1, 2, padding=1, padding_mode="circular"),
        27,
        (1, 2, 2, 2),
    ),
    "ConvTranspose1d": Case(lambda: nn.ConvTranspose1d(2, 2, 3), 12, (2, 4)),
    "ConvTranspose2d": Case(
        lambda: nn.ConvTranspose2d(1, 2, 2, stride=2), 72, (1, 3, 3)
    ),
    "ConvTranspose3d": Case(lambda: nn.ConvTranspose3d(1, 1, 2), 27, (1, 2, 2, 2)),
    "BatchNorm1d": Case(_after_linear(nn.BatchNorm1d(6)), 6, (4,)),
    "BatchNorm1d-train": Case(_after_linear(nn.BatchNorm1d(6)), 6, (4,), training=True),
    "BatchNorm2d": Case(
        lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), 8, (1, 4, 4)
    ),
    "BatchNorm3d": Case(lambda: nn.BatchNorm3d(1), 8, (1, 2, 2, 2)),
    "SyncBatchNorm": Case(_after_linear(nn.SyncBatchNorm(6)), 6, (4,)),
    "InstanceNorm1d": Case(lambda: nn.InstanceNorm1d(2, affine=True), 12, (2, 6)),
    "InstanceNorm1d-running-stats": Case(
        lambda: nn.InstanceNorm1d(2, affine=True, track_running_stats=True),
        12,
        (2, 6),
    ),
    "InstanceNorm1d-running-stats-train": Case(
        lambda: nn.InstanceNorm1d(2, affine=True, track_running_stats=True),
        12,
        (2, 6),
        training=True,
    ),
    "InstanceNorm2d": Case(lambda: nn.InstanceNorm2d(2, affine=True), 18, (2, 3, 3)),
    "InstanceNorm3d": Case(lambda: nn.InstanceNorm3d(1, affine=True), 8, (1, 2, 2, 2)),
    "LayerNorm": Case(_after_linear(nn.LayerNorm(6)), 6, (4,)),
    "GroupNorm": Case(
        lambda: nn.Sequential(nn.Conv1d(2, 4, 3), nn.GroupNorm(2, 4)), 16, (2, 6)
    ),
    "RMSNorm": Case(_after_linear(nn.RMSNorm(6)), 6, (4,)),
    "Embedding": Case(lambda: nn.Embedding(7, 4), 8, (2,), tokens=7),
    "Embedding-padding_idx": Case(
        lambda: nn.Embedding(7, 4, padding_idx=0), 8, (2,), tokens=7
    ),
    "Embedding-max_norm": Case(
        lambda: nn.Embedding(7, 4, max_norm=1.0), 8, (2,), tokens=7
    ),
    "Embedding-scale_grad_by_freq": Case(
        lambda: nn.Embedding(7, 4, scale_grad_by_freq=True), 8, (2,), tokens=7
    ),
    "EmbeddingBag": Case(lambda: nn.EmbeddingBag(7, 4), 4, (3,), tokens=7),
    "EmbeddingBag-max-padding_idx": Case(
        lambda: nn.EmbeddingBag(7, 4, mode="max", padding_idx=0), 4, (3,), tokens=7
    ),
    "EmbeddingBag-sum-padding_idx": Case(
        lambda: nn.EmbeddingBag(7, 4, mode="sum", padding_idx=0), 4, (3,), tokens=7
    ),
    "MultiheadAttention": Case(
        lambda: nn.MultiheadAttention(4, 2, batch_first=True),
        12,
        (3, 4),
        _self_attention,
    ),
    "MultiheadAttention-add_bias_kv": Case(
        lambda: nn.MultiheadAttention(4, 2, add_bias_kv=True, batch_first=True),
        12,
        (3, 4),
        _self_attention,
    ),
    "MultiheadAttention-add_zero_attn": Case(
        lambda: nn.MultiheadAttention(4, 2, add_zero_attn=True, batch_first=True),
        12,
        (3, 4),
        _self_attention,
    ),
    "MultiheadAttention-returned-weights": Case(
        lambda: nn.MultiheadAttention(4, 2, batch_first=True),
        21,
        (3, 4),
        _attention_weights,
        refused_while_running=True,
    ),
    "MultiheadAttention-dropout-train": Case(
        lambda: nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True),
        12,
        (3, 4),
        _self_attention,
        training=True,
    ),
    "TransformerEncoderLayer": Case(
        lambda: nn.TransformerEncoderLayer(**_layer(), batch_first=True), 12, (3, 4)
    ),
    "TransformerEncoder": Case(
        lambda: nn.TransformerEncoder(
            nn.TransformerEncoderLayer(**_layer(), batch_first=True),
            2,
            enable_nested_tensor=False,
        ),
        12,
        (3, 4),
    ),
    "TransformerDecoderLayer": Case(
        lambda: nn.TransformerDecoderLayer(**_layer(), batch_first=True),
        12,
        (3, 4),
        _with_memory,
    ),
    "TransformerDecoder": Case(
        lambda: nn.TransformerDecoder(
            nn.TransformerDecoderLayer(**_layer(), batch_first=True), 1
        ),
        12,
        (3, 4),
        _with_memory,
    ),
    "Transformer": Case(
        lambda: nn.Transformer(
            **_layer(),
            num_encoder_layers=1,
            num_decoder_layers=1,
            batch_first=True,
        ),
        12,
        (3, 4),
        _with_memory,
    ),
    "RNN": Case(lambda: nn.RNN(4, 3, batch_first=True), 9, (3, 4), _first),
    "LSTM": Case(lambda: nn.LSTM(4, 3, batch_first=True), 9, (3, 4), _first),
    "GRU": Case(lambda: nn.GRU(4, 3, batch_first=True), 9, (3, 4), _first),
    "GRU-packed": Case(
        lambda: nn.GRU(4, 3, batch_first=True),
        3,
        (3, 4),
        _packed,
        refused_while_running=True,
    ),
    "LSTM-dropout-train": Case(
        lambda: nn.LSTM(4, 3, num_layers=2, dropout=0.5, batch_first=True),
        9,
        (3, 4),
        _first,
        training=True,
    ),
    "RNNCell": Case(lambda: nn.RNNCell(4, 6), 6, (4,)),
    "LSTMCell": Case(lambda: nn.LSTMCell(4, 6), 6, (4,), _first),
    "GRUCell": Case(lambda: nn.GRUCell(4, 6), 6, (4,)),
    "AdaptiveLogSoftmaxWithLoss": Case(
        lambda: nn.AdaptiveLogSoftmaxWithLoss(4, 5, cutoffs=[2]), 5, (4,), _log_prob
    ),
    "weight_norm-Linear": Case(lambda: weight_norm(nn.Linear(4, 6)), 6, (4,)),
    "custom-parameter": Case(
        lambda: nn.Sequential(nn.Linear(4, 6), _Scale(6)), 6, (4,)
    ),
    # modules without a rule of their own (the local rule): other libraries'
    # building blocks, mirrored
    "HF-Conv1D": Case(lambda: HFConv1D(5, 4), 15, (3, 4)),
    # the real one: a closed-form rule (a Linear with its weight transposed)
    "transformers-Conv1D": Case(lambda: _transformers_conv1d(5, 4), 15, (3, 4)),
    "ViT-like-embeddings": Case(ViTLikeEmbeddings, 20, (2, 4, 4)),
    "BERT-like-embeddings": Case(BertLikeEmbeddings, 12, (3,), tokens=7),
    "hand-written-RMSNorm": Case(
        lambda: nn.Sequential(nn.Linear(4, 6), HandRMSNorm(6)), 6, (4,)
    ),
    # torchvision's residual blocks: nn.ReLU(inplace=True) after batch norm and
    # `out += identity` write into the outputs of parameterised modules
    "BasicBlock-in-place": Case(lambda: BasicBlock(2, 2), 18, (2, 3, 3)),
    "Bottleneck-in-place-downsample": Case(
        lambda: Bottleneck(
            2, 1, downsample=nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4))
        ),
        36,
        (2, 3, 3),
    ),
    # MobileNetV3's block: Hardswish(inplace=True), a squeeze-excitation gate with
    # Hardsigmoid (no double backward in PyTorch), `result += input`
    "InvertedResidual-SE-hardswish": Case(
        lambda: InvertedResidual(
            InvertedResidualConfig(8, 3, 16, 8, True, "HS", 1, 1, 1.0),
            nn.BatchNorm2d,
        ),
        32,
        (8, 2, 2),
    ),
}


#: Cases both engines must get right, not refuse: the modules the BackPACK
#: backends once sent elsewhere (the local rule takes them now) and the building
#: blocks of downloaded models.
MUST_BE_RIGHT = frozenset(
    {
        "Bilinear",
        "Conv2d-groups-reflect",
        "Conv3d-circular",
        "SyncBatchNorm",
        "RMSNorm",
        "EmbeddingBag",
        "EmbeddingBag-max-padding_idx",
        "EmbeddingBag-sum-padding_idx",
        "RNNCell",
        "LSTMCell",
        "GRUCell",
        "custom-parameter",
        "HF-Conv1D",
        "transformers-Conv1D",
        "ViT-like-embeddings",
        "BERT-like-embeddings",
        "hand-written-RMSNorm",
        "BasicBlock-in-place",
        "Bottleneck-in-place-downsample",
        "InvertedResidual-SE-hardswish",
    }
)
