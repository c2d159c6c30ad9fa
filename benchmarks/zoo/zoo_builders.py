"""The zoo's models and synthetic data for ``zoo_flavours.py`` (nothing is downloaded).

Hugging Face ``transformers`` GPT-2, BERT and ViT and torchvision's ResNet
(``BasicBlock``, one per stage) and MobileNetV3-small, built from configs with random
weights in float32 and eval mode; peft's LoRA on GPT-2's ``c_attn`` as in
laplace-torch's Hugging Face example (r = 4, alpha = 16), with both LoRA factors
drawn at random (peft's default zero ``B`` stands in for an untrained adapter). Text
models are wrapped as that example wraps GPT-2: ``forward`` takes one dict-like batch
(a ``BatchEncoding``) and returns the logits. The data: seeded random token ids
(lengths from half the sequence to all of it, right-padded with id 0 and masked) or
normal pixels, seeded random labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

PAD = 0


class HFClassifier(nn.Module):
    """A Hugging Face sequence classifier called with one dict-like batch."""

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


def gpt2(size: dict) -> nn.Module:
    """GPT-2 for sequence classification (``sdpa`` attention, transformers' default)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(
        n_layer=size["layers"],
        n_head=size["heads"],
        n_embd=size["width"],
        vocab_size=size["vocab"],
        n_positions=size["seq"],
        num_labels=size["classes"],
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=1,
    )
    hf = GPT2ForSequenceClassification(config)
    return HFClassifier(hf, ("input_ids", "attention_mask"))


def bert(size: dict) -> nn.Module:
    """BERT for sequence classification."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        hidden_size=size["width"],
        intermediate_size=4 * size["width"],
        vocab_size=size["vocab"],
        max_position_embeddings=size["seq"],
        num_labels=size["classes"],
        pad_token_id=PAD,
    )
    hf = BertForSequenceClassification(config)
    return HFClassifier(hf, ("input_ids", "attention_mask", "token_type_ids"))


def vit(size: dict) -> nn.Module:
    """ViT for image classification."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=size["image"],
        patch_size=size["patch"],
        num_channels=3,
        hidden_size=size["width"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        intermediate_size=4 * size["width"],
        num_labels=size["classes"],
    )
    return HFImageClassifier(ViTForImageClassification(config))


def gpt2_lora(size: dict) -> nn.Module:
    """GPT-2 with peft's LoRA on ``c_attn``: laplace-torch's example's config.

    ``init_lora_weights=False`` draws both factors at random (a trained adapter);
    ``fan_in_fan_out=True`` is what peft sets for GPT-2's ``Conv1D`` anyway.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=size["rank"],
        lora_alpha=16,
        target_modules=["c_attn"],
        lora_dropout=0.1,
        bias="none",
        init_lora_weights=False,
        fan_in_fan_out=True,
    )
    return get_peft_model(gpt2(size), config)


def resnet(size: dict) -> nn.Module:
    """torchvision's ResNet with one ``BasicBlock`` per stage."""
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=size["classes"])


def mobilenet(size: dict) -> nn.Module:
    """torchvision's MobileNetV3-small (width multiplier 1 unless ``width_mult``)."""
    from torchvision.models import mobilenet_v3_small

    width = size.get("width_mult", 1.0)
    return mobilenet_v3_small(num_classes=size["classes"], width_mult=width)


BUILDERS = {
    "gpt2": gpt2,
    "bert": bert,
    "vit": vit,
    "gpt2-lora": gpt2_lora,
    "resnet": resnet,
    "mobilenet": mobilenet,
}
#: The models whose input is a dict-like batch of token ids.
TEXT = {"gpt2", "bert", "gpt2-lora"}


def build(name: str, size: dict, seed: int = 0) -> nn.Module:
    """A seeded float32 model in eval mode."""
    torch.manual_seed(seed)
    return BUILDERS[name](size).float().eval()


def text_rows(n: int, size: dict, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` right-padded token sequences of length ``seq``, with labels."""
    gen = torch.Generator().manual_seed(seed)
    seq = size["seq"]
    rows = []
    for _ in range(n):
        length = int(torch.randint(seq // 2, seq + 1, (), generator=gen))
        ids = torch.full((seq,), PAD)
        ids[:length] = torch.randint(2, size["vocab"], (length,), generator=gen)
        rows.append(
            {
                "input_ids": ids,
                "attention_mask": (torch.arange(seq) < length).long(),
                "token_type_ids": torch.zeros(seq, dtype=torch.long),
                "labels": torch.randint(0, size["classes"], (), generator=gen),
            }
        )
    return rows


def _collate(rows: list[dict]) -> Any:
    from transformers import BatchEncoding

    return BatchEncoding(default_collate(rows))


def data(name: str, size: dict, n: int, batch: int, n_test: int):
    """The training loader and a test batch (``BatchEncoding`` or pixels).

    Returns
    -------
    loader : DataLoader
        ``BatchEncoding`` batches (labels under ``"labels"``, as laplace-torch
        reads them) or ``(pixels, labels)``.
    x_test : BatchEncoding or torch.Tensor
        ``n_test`` test inputs.

    """
    if name in TEXT:
        loader = DataLoader(
            text_rows(n, size, 1), batch_size=batch, collate_fn=_collate
        )
        test = _collate(text_rows(n_test, size, 2))
        del test["labels"]
        return loader, test
    gen = torch.Generator().manual_seed(1)
    shape = (3, size["image"], size["image"])
    x = torch.randn(n, *shape, generator=gen)
    y = torch.randint(0, size["classes"], (n,), generator=gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch)
    return loader, torch.randn(n_test, *shape, generator=gen)
