"""Models with frozen parameters, shared by the backend and adapter tests.

A LoRA-style model (a frozen ``nn.Linear`` plus trainable low-rank factors used as
``W x + B(A x)``, the way PEFT's LoRA layers compute) and a partly frozen MLP.
Nothing here imports ``laplace_diffjac``.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRALinear(nn.Module):
    """``base(x) + B(A(x))`` with ``base`` frozen and rank-``r`` factors trainable."""

    def __init__(self, n_in: int, n_out: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.A = nn.Linear(n_in, rank, bias=False)
        self.B = nn.Linear(rank, n_out, bias=False)
        self.base.requires_grad_(False)
        nn.init.normal_(self.B.weight, std=0.5)  # PEFT starts at 0; trained != 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.B(self.A(x))


def lora_model(n_outputs: int) -> nn.Module:
    """Seeded float64 ``3 -> 6 -> 5 -> C``: two LoRA layers, a trainable head."""
    torch.manual_seed(0)
    return (
        nn.Sequential(
            LoRALinear(3, 6, 2),
            nn.Tanh(),
            LoRALinear(6, 5, 2),
            nn.Sigmoid(),
            nn.Linear(5, n_outputs),
        )
        .double()
        .eval()
    )


def partly_frozen_mlp(n_outputs: int) -> nn.Module:
    """Seeded float64 MLP with its first layer and one bias frozen."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 6),
        nn.Tanh(),
        nn.Linear(6, 5),
        nn.Sigmoid(),
        nn.Linear(5, n_outputs),
    )
    model = model.double().eval()
    model[0].requires_grad_(False)
    model[2].bias.requires_grad_(False)
    return model


FROZEN_MODELS = {"lora": lora_model, "partly-frozen": partly_frozen_mlp}


def trainable(model: nn.Module) -> list[torch.Tensor]:
    """Parameters with ``requires_grad``, in ``model.parameters()`` order."""
    return [p for p in model.parameters() if p.requires_grad]
