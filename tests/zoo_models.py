"""The models people download, built from small configs (nothing is downloaded).

Hugging Face ``transformers`` (GPT-2, BERT, ViT), ``peft``'s LoRA on GPT-2's
``c_attn`` as in laplace-torch's own Hugging Face example, and torchvision's ResNet
(``BasicBlock``, one block per stage) and MobileNetV3-small. Random weights, float64,
eval mode; BatchNorm running statistics randomised so that they matter. Text models
are wrapped as laplace-torch's example wraps GPT-2: ``forward`` takes one dict-like
batch (a ``BatchEncoding``) and returns the logits ``(batch, classes)``. The cases
the zoo's tests share (model, batch, likelihood) are :data:`HF_CASES` and
:data:`TORCHVISION_CASES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB = 32
PAD = 0


class HFClassifier(nn.Module):
    """A Hugging Face sequence classifier called with one dict-like batch.

    Parameters
    ----------
    hf_model : torch.nn.Module
        A ``*ForSequenceClassification`` model.
    keys : tuple of str
        The batch's entries passed on as keyword arguments.

    """

    def __init__(self, hf_model: nn.Module, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.keys = keys

    def forward(self, data: Mapping) -> torch.Tensor:
        return self.hf_model(**{k: data[k] for k in self.keys}).logits


class HFImageClassifier(nn.Module):
    """A Hugging Face image classifier called with a pixel tensor."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf_model = hf_model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.hf_model(pixel_values=pixels).logits


def _finish(model: nn.Module, seed: int) -> nn.Module:
    model = model.double().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.normal_(0.0, 0.5, generator=gen)
            module.running_var.uniform_(0.5, 2.0, generator=gen)
    return model


def gpt2(num_labels: int = 2, *, attention: str = "sdpa", seed: int = 0) -> nn.Module:
    """GPT-2 (one block, width 8, two heads) for sequence classification."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=8,
        vocab_size=VOCAB,
        n_positions=16,
        num_labels=num_labels,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=1,
        attn_implementation=attention,
    )
    hf = GPT2ForSequenceClassification(config)
    return _finish(HFClassifier(hf, ("input_ids", "attention_mask")), seed)


def bert(num_labels: int = 2, *, seed: int = 0) -> nn.Module:
    """BERT (one layer, width 8, two heads) for sequence classification."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        num_hidden_layers=1,
        num_attention_heads=2,
        hidden_size=8,
        intermediate_size=16,
        vocab_size=VOCAB,
        max_position_embeddings=16,
        num_labels=num_labels,
        pad_token_id=PAD,
    )
    hf = BertForSequenceClassification(config)
    keys = ("input_ids", "attention_mask", "token_type_ids")
    return _finish(HFClassifier(hf, keys), seed)


def vit(num_labels: int = 2, *, seed: int = 0) -> nn.Module:
    """ViT (8×8 images, 4×4 patches, one layer, width 8) for classification."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        num_labels=num_labels,
    )
    return _finish(HFImageClassifier(ViTForImageClassification(config)), seed)


def gpt2_lora(num_labels: int = 2, *, seed: int = 0) -> nn.Module:
    """GPT-2 with peft's LoRA on ``c_attn`` (r = 2), laplace-torch's example setup.

    ``init_lora_weights=False`` draws both LoRA factors at random (peft's default
    zero ``B`` would make every Jacobian of ``A`` vanish); ``fan_in_fan_out=True`` is
    what peft sets for ``Conv1D`` anyway, without its warning.
    """
    from peft import LoraConfig, get_peft_model

    base = gpt2(num_labels, seed=seed)
    config = LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["c_attn"],
        lora_dropout=0.1,
        bias="none",
        init_lora_weights=False,
        fan_in_fan_out=True,  # GPT-2's Conv1D stores (in, out); peft warns otherwise
    )
    torch.manual_seed(seed + 2)
    return _finish(get_peft_model(base, config), seed)


def resnet(num_classes: int = 10, *, seed: int = 0) -> nn.Module:
    """torchvision's ResNet with one ``BasicBlock`` per stage, 3×32×32 inputs."""
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(seed)
    return _finish(ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes), seed)


def mobilenet(num_classes: int = 10, *, seed: int = 0) -> nn.Module:
    """torchvision's MobileNetV3-small (width 0.25), 3×32×32 inputs."""
    from torchvision.models import mobilenet_v3_small

    torch.manual_seed(seed)
    return _finish(mobilenet_v3_small(num_classes=num_classes, width_mult=0.25), seed)


def text_batch(batch: int = 3, seq: int = 5, *, seed: int = 0):
    """A padded ``BatchEncoding``: the first row's last two tokens are padding."""
    from transformers import BatchEncoding

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    ids[0, -2:] = PAD
    mask[0, -2:] = 0
    types = torch.zeros(batch, seq, dtype=torch.long)
    types[:, seq // 2 :] = 1
    return BatchEncoding(
        {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    )


def image_batch(batch: int = 2, size: int = 8, *, seed: int = 0) -> torch.Tensor:
    """Pixels ``(batch, 3, size, size)`` in float64."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, dtype=torch.float64, generator=gen)


def labels(batch: int, classes: int = 2, *, seed: int = 0) -> torch.Tensor:
    """Class labels ``(batch,)``."""
    gen = torch.Generator().manual_seed(seed + 3)
    return torch.randint(0, classes, (batch,), generator=gen)


def targets(likelihood: str, batch: int, outputs: int, *, seed: int = 0):
    """Class labels ``(batch,)`` or regression targets ``(batch, outputs)``."""
    if likelihood == "classification":
        return labels(batch, outputs, seed=seed)
    gen = torch.Generator().manual_seed(seed + 4)
    return torch.randn(batch, outputs, dtype=torch.float64, generator=gen)


@dataclass(frozen=True)
class ZooCase:
    """A zoo model, its batch and likelihood: the cases every zoo test shares.

    Attributes
    ----------
    name : str
        Test id.
    build : callable
        Returns a fresh seeded float64 model in eval mode.
    inputs : callable
        Returns the input batch: a padded ``BatchEncoding`` or pixels.
    outputs : int
        Classes (or regression outputs).
    likelihood : str
        ``'classification'`` or ``'regression'``.

    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], Any]
    outputs: int = 2
    likelihood: str = "classification"

    def model(self) -> nn.Module:
        return self.build()

    def batch(self) -> tuple[Any, torch.Tensor]:
        x = self.inputs()
        n = len(x["input_ids"]) if isinstance(x, Mapping) else len(x)
        return x, targets(self.likelihood, n, self.outputs)


#: Hugging Face models (with LoRA) on padded ``BatchEncoding`` batches and ViT.
HF_CASES = [
    ZooCase("gpt2-sdpa", gpt2, text_batch),
    ZooCase("gpt2-eager", lambda: gpt2(attention="eager"), text_batch),
    ZooCase("bert", bert, text_batch),
    ZooCase("vit", vit, lambda: image_batch(3, 8)),
    ZooCase("gpt2-lora", gpt2_lora, text_batch),
    ZooCase("bert-regression", bert, text_batch, likelihood="regression"),
]

#: torchvision's ResNet (3×32×32) and MobileNetV3-small (3×64×64, so that its last
#: depthwise convolutions still see 2×2 maps), two samples, three classes.
TORCHVISION_CASES = [
    ZooCase("resnet", lambda: resnet(3), lambda: image_batch(2, 32), outputs=3),
    ZooCase("mobilenet", lambda: mobilenet(3), lambda: image_batch(2, 64), outputs=3),
]
