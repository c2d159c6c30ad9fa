"""Elementwise activations the structured NTK supports, with their derivatives."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

__all__ = ["ACTIVATIONS"]

_Derivative = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _gelu(m: nn.GELU, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    if m.approximate == "tanh":
        k = (2.0 / torch.pi) ** 0.5
        t = torch.tanh(k * (z + 0.044715 * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t**2) * k * (1 + 3 * 0.044715 * z**2)
    cdf = 0.5 * (1 + torch.erf(z * 2**-0.5))
    pdf = torch.exp(-0.5 * z**2) / (2 * torch.pi) ** 0.5
    return cdf + z * pdf


def _silu(m: nn.Module, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def _softplus(m: nn.Softplus, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    bz = m.beta * z
    return torch.where(bz > m.threshold, torch.ones_like(z), torch.sigmoid(bz))


def _elu(m: nn.ELU, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.where(z > 0, torch.ones_like(z), m.alpha * torch.exp(z))


def _leaky_relu(m: nn.LeakyReLU, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.where(z > 0, torch.ones_like(z), torch.full_like(z, m.negative_slope))


#: Elementwise activations and their derivatives ``d(module, z, module(z))``.
ACTIVATIONS: dict[type[nn.Module], _Derivative] = {
    nn.Tanh: lambda m, z, a: 1 - a**2,
    nn.Sigmoid: lambda m, z, a: a * (1 - a),
    nn.ReLU: lambda m, z, a: (z > 0).to(z.dtype),
    nn.GELU: cast(_Derivative, _gelu),
    nn.SiLU: _silu,
    nn.Softplus: cast(_Derivative, _softplus),
    nn.ELU: cast(_Derivative, _elu),
    nn.LeakyReLU: cast(_Derivative, _leaky_relu),
}
