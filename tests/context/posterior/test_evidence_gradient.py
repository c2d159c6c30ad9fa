"""The evidence objective in Z, δ and σ against dense torch.func autograd."""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.context import ContextPosterior, evidence_loss_backward
from tests.context.helpers import MLP, dense_bound, evidence_data


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_value_and_gradients_match_dense_autograd(backend_cls, likelihood):
    model, x, y, loader = evidence_data(likelihood, n=12)
    z = MLP.inputs(3, 11).requires_grad_()
    log_prec = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    log_sigma = torch.tensor(-0.5, dtype=torch.float64, requires_grad=True)
    reg = likelihood == "regression"
    loss = evidence_loss_backward(
        backend_cls(model, likelihood),
        z,
        loader,
        likelihood,
        log_prec.exp(),
        log_sigma.exp(),
        jitter=0.0,
        inputs=[z, log_prec, log_sigma] if reg else [z, log_prec],
    )
    assert all(p.grad is None for p in model.parameters())
    z_ref = z.detach().clone().requires_grad_()
    lp = log_prec.detach().clone().requires_grad_()
    ls = log_sigma.detach().clone().requires_grad_()
    sigma = ls.exp() if reg else 1.0
    dense, _ = dense_bound(model, x, y, z_ref, likelihood, lp.exp(), sigma)
    leaves = [z_ref, lp, ls] if reg else [z_ref, lp]
    grads = torch.autograd.grad(-dense, leaves)
    torch.testing.assert_close(loss, -dense.detach(), rtol=1e-7, atol=1e-10)
    for leaf, g in zip([z, log_prec, log_sigma], grads):
        torch.testing.assert_close(leaf.grad, g, rtol=1e-6, atol=1e-9)
    cp = ContextPosterior(model, likelihood, z.detach(), jitter=0.0).fit(loader)
    s = log_sigma.detach().exp() if reg else None
    expected = cp.log_marginal_likelihood(log_prec.detach().exp(), s)
    torch.testing.assert_close(-loss, expected, rtol=1e-10, atol=0)
