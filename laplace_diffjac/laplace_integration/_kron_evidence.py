"""``δ`` and ``σ`` by laplace-torch's KFAC Laplace evidence, as laplace-bayesopt.

laplace-bayesopt's ``LaplaceBoTorch`` tunes a regression network's prior
precision ``δ`` and noise ``σ`` after training: a ``KronLaplace`` of all the
network's weights (its ``last_layer=False`` default), then Adam (learning rate
0.1) on ``log δ`` and ``log σ`` from ``1``, against ``log_marginal_likelihood``.
:class:`~laplace_diffjac.bayesopt.ContextBoTorch` (``evidence='kron'``) chooses
them the same way. laplace-torch's ``Laplace(...)`` defaults to the last layer,
so the subset is named here.
"""

from __future__ import annotations

import math
import warnings

import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..backends import DiffBackPackGGN

__all__ = ["KRON_SCALAR_WARNING", "kron_evidence_hyperparameters"]

#: laplace-torch's warning (``laplace/utils/matrix.py``) when its Kronecker
#: log-determinant converts a prior precision that requires grad to a float.
KRON_SCALAR_WARNING = "Converting a tensor with requires_grad=True to a scalar"


def kron_evidence_hyperparameters(
    model: nn.Module,
    X: torch.Tensor,
    Y: torch.Tensor,
    batch_size: int,
    n_steps: int,
    sigma_noise: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``δ`` and ``σ`` that maximise the KFAC Laplace evidence of ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        The trained regression network (not modified: the fit goes through
        :class:`~laplace_diffjac.DiffBackPackGGN`).
    X, Y : torch.Tensor
        ``(N, d)`` inputs and ``(N, K)`` targets.
    batch_size : int
        Minibatches of the fit (laplace-bayesopt: its training batch size).
    n_steps : int
        Adam steps (laplace-bayesopt's ``posthoc_marglik_iters``).
    sigma_noise : float, optional
        A fixed ``σ``; only ``δ`` is tuned then.

    Returns
    -------
    tuple of torch.Tensor
        Prior precision ``(1,)`` and ``σ`` ``(1,)``, detached, in ``X``'s dtype.

    """
    laplace = Laplace(
        model,
        "regression",
        subset_of_weights="all",
        hessian_structure="kron",
        backend=DiffBackPackGGN,
    )
    laplace.fit(DataLoader(TensorDataset(X, Y), batch_size=batch_size))
    dtype, device = X.dtype, X.device
    log_prior = torch.ones(1, dtype=dtype, device=device, requires_grad=True)
    learn_sigma = sigma_noise is None
    log_sigma_start = 1.0 if sigma_noise is None else math.log(sigma_noise)
    log_sigma = torch.full(
        (1,), log_sigma_start, dtype=dtype, device=device, requires_grad=learn_sigma
    )
    optimizer = torch.optim.Adam(
        [log_prior, log_sigma] if learn_sigma else [log_prior], lr=1e-1
    )
    for _ in range(n_steps):
        optimizer.zero_grad()
        with warnings.catch_warnings():
            # laplace-torch's Kronecker log-determinant calls float() on the
            # prior precision, whose graph it does not need (a UserWarning).
            warnings.filterwarnings("ignore", KRON_SCALAR_WARNING, UserWarning)
            evidence = laplace.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        (-evidence).backward()
        optimizer.step()
    return log_prior.detach().exp(), log_sigma.detach().exp()
