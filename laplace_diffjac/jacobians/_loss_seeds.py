"""The rows the curvature differentiates: square roots of the loss Hessian, gradients.

The GGN of a sum-reduced loss is ``Σ_b J_bᵀ Λ_b J_b`` with ``Λ_b`` the loss Hessian
in the outputs of sample ``b``. With a factorisation ``Λ_b = Σ_v s_bv s_bvᵀ`` it is
``Σ_b Σ_v (s_bvᵀ J_b)ᵀ (s_bvᵀ J_b)``: the engine differentiates the rows
``s_bvᵀ f_b`` instead of the outputs, and every curvature (diagonal, Kronecker
factors) is a sum of squares of their per-layer factors. The seeds ``s`` are
BackPACK's, so that results equal laplace-torch's BackPACK backends: the symmetric
square root of ``diag(p) − p pᵀ`` for cross-entropy, ``√2 I`` for the summed squared
error, and for the Monte-Carlo Fisher one gradient of the loss at a label drawn
from the model (the same draws from torch's global generator as BackPACK's
``DiagGGNMC``/``KFAC``). The empirical Fisher's seed is the loss gradient itself.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributions import Categorical, Normal

from ..errors import InvalidInputError

__all__ = ["ggn_seeds", "gradient_seeds"]


def ggn_seeds(
    lossfunc: nn.Module, f: torch.Tensor, *, stochastic: bool = False
) -> torch.Tensor:
    """Rows ``s_bv`` with ``Σ_v s_bv s_bvᵀ`` the loss Hessian (or a one-sample MC).

    Parameters
    ----------
    lossfunc : torch.nn.Module
        ``nn.CrossEntropyLoss`` or ``nn.MSELoss``, sum-reduced.
    f : torch.Tensor
        Detached model output ``(batch, C)``.
    stochastic : bool, default=False
        One Monte-Carlo sample of the Fisher instead of the exact Hessian.

    Returns
    -------
    torch.Tensor
        ``(C, batch, C)`` exact, ``(1, batch, C)`` stochastic.

    """
    _check_sum_reduction(lossfunc)
    if isinstance(lossfunc, nn.CrossEntropyLoss):
        probs = torch.softmax(f, dim=1)
        if stochastic:
            labels = Categorical(probs).sample(torch.Size([1]))  # (1, batch)
            onehot = nn.functional.one_hot(labels, probs.shape[1]).to(probs.dtype)
            return probs.unsqueeze(0) - onehot
        tau = probs.sqrt()
        eye = torch.eye(f.shape[1], dtype=f.dtype, device=f.device)
        # s[v, b, c] = tau[b, c] (δ_vc − tau[b, v] tau[b, c])
        return tau * (eye[:, None, :] - tau.T[:, :, None] * tau)
    if stochastic:
        labels = Normal(f, torch.tensor(math.sqrt(0.5), dtype=f.dtype, device=f.device))
        return 2 * (labels.sample(torch.Size([1])) - f.unsqueeze(0))
    eye = torch.eye(f.shape[1], dtype=f.dtype, device=f.device) * math.sqrt(2.0)
    return eye[:, None, :].expand(f.shape[1], f.shape[0], f.shape[1])


def gradient_seeds(
    lossfunc: nn.Module, f: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """The loss gradient in the outputs, one row per sample: ``(1, batch, C)``.

    Parameters
    ----------
    lossfunc : torch.nn.Module
        ``nn.CrossEntropyLoss`` or ``nn.MSELoss``, sum-reduced.
    f : torch.Tensor
        Detached model output ``(batch, C)``.
    y : torch.Tensor
        Targets as ``lossfunc`` takes them with ``f``.

    Returns
    -------
    torch.Tensor
        ``(1, batch, C)``: ``∂ℓ_b / ∂f_b`` (a sum-reduced loss separates by sample).

    """
    _check_sum_reduction(lossfunc)
    with torch.enable_grad():
        out = f.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(lossfunc(out, _targets_like(y, out)), out)
    return grad.unsqueeze(0)


def model_loss(lossfunc: nn.Module, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``lossfunc(f, y)`` with ``f`` ``(batch, C)``, targets shaped to match.

    Returns
    -------
    torch.Tensor
        The detached scalar loss.

    """
    return lossfunc(f.detach(), _targets_like(y, f)).detach()


def _targets_like(y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Regression targets ``(batch,)`` of a one-output model as ``(batch, 1)``."""
    if y.is_floating_point() and y.dim() == 1 and f.dim() == 2 and f.shape[1] == 1:
        return y.unsqueeze(1)
    return y


def _check_sum_reduction(lossfunc: nn.Module) -> None:
    if not isinstance(lossfunc, (nn.CrossEntropyLoss, nn.MSELoss)):
        raise InvalidInputError(
            f"The curvature is defined for laplace-torch's losses, CrossEntropyLoss "
            f"and MSELoss; got {type(lossfunc).__name__}."
        )
    if lossfunc.reduction != "sum":
        raise InvalidInputError(
            f"{type(lossfunc).__name__} must be sum-reduced (laplace-torch's "
            f"convention), not reduction='{lossfunc.reduction}'."
        )
