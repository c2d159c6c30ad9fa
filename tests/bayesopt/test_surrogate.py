"""The surrogate's training pieces against hand-written references."""

from __future__ import annotations

import torch

from laplace_diffjac.bayesopt._surrogate import _adam


def _reference_adam(
    param: torch.Tensor,
    grads: list[torch.Tensor],
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.Tensor:
    """Adam with L2 weight decay (Kingma & Ba, Algorithm 1), written out."""
    p = param.detach().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t, grad in enumerate(grads, start=1):
        g = grad + weight_decay * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat = m / (1 - betas[0] ** t)
        v_hat = v / (1 - betas[1] ** t)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


def test_adam_takes_adams_steps_with_l2_weight_decay() -> None:
    generator = torch.Generator().manual_seed(0)
    param = torch.randn(7, 3, generator=generator, dtype=torch.float64)
    grads = [
        torch.randn(7, 3, generator=generator, dtype=torch.float64) for _ in range(5)
    ]
    weight = param.clone().requires_grad_(True)
    optimizer = _adam([weight], lr=0.05, weight_decay=0.3)
    for grad in grads:
        weight.grad = grad.clone()
        optimizer.step()
    expected = _reference_adam(param, grads, lr=0.05, weight_decay=0.3)
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-12, atol=1e-14)
    assert not torch.equal(weight.detach(), param)
