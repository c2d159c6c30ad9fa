"""The GGN likelihood Hessian ``Λₙ`` with respect to the network output.

``Λₙ = -∇²_f log p(yₙ | f)`` at the MAP output, scaled as laplace-torch scales it
(``1 / (σ² T)`` for regression, ``1 / T`` for classification): ``I / (σ² T)`` for a
Gaussian likelihood and ``(diag(p) − p pᵀ) / T`` with ``p = softmax(f)`` for a
categorical one. It does not depend on the targets.
"""

from __future__ import annotations

import torch

__all__ = ["output_hessians"]


def output_hessians(
    f: torch.Tensor,
    likelihood: str,
    sigma_noise: float | torch.Tensor = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-input likelihood Hessians ``Λₙ`` of the GGN.

    Parameters
    ----------
    f : torch.Tensor
        Model outputs ``(batch, C)``.
    likelihood : {'regression', 'classification'}
        The likelihood.
    sigma_noise : float or torch.Tensor, default=1.0
        Observation noise standard deviation (regression only).
    temperature : float, default=1.0
        Likelihood temperature ``T``.

    Returns
    -------
    torch.Tensor
        ``(batch, C, C)``, symmetric positive semi-definite.

    Raises
    ------
    ValueError
        For an unknown likelihood.

    """
    batch, C = f.shape
    if likelihood == "regression":
        sigma2 = torch.as_tensor(sigma_noise, dtype=f.dtype, device=f.device) ** 2
        eye = torch.eye(C, dtype=f.dtype, device=f.device)
        return (eye / (sigma2 * temperature)).expand(batch, C, C).clone()
    if likelihood == "classification":
        p = torch.softmax(f, dim=-1)
        return (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) / temperature
    raise ValueError(
        f"likelihood must be 'regression' or 'classification', got {likelihood!r}."
    )
