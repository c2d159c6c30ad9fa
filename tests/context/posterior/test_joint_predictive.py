"""``ContextPosterior.joint_predictive``: batches of q-batches, each its own joint.

Each q-batch's covariance must equal the joint covariance ``la(x, joint=True)``
of that q-batch alone (compared with a dense DTC formula in ``tests/bayesopt``),
with no covariance across batches; its gradient in ``x`` must match central
differences.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import ContextPosterior
from laplace_diffjac.errors import InvalidInputError


def _posterior(outputs: int, mean: str) -> ContextPosterior:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, outputs)).double()
    x = torch.randn(20, 2, dtype=torch.float64)
    y = torch.randn(20, outputs, dtype=torch.float64)
    la = ContextPosterior(
        model, "regression", x[:6], sigma_noise=0.3, prior_precision=2.0,
        enable_backprop=True, predictive_mean=mean,
    )  # fmt: skip
    return la.fit((x, y))


@pytest.mark.parametrize("mean", ["network", "dual"])
@pytest.mark.parametrize("outputs", [1, 3])
def test_each_q_batch_is_the_joint_of_its_own_inputs(outputs, mean):
    la = _posterior(outputs, mean)
    x = torch.randn(2, 3, 4, 2, generator=torch.Generator().manual_seed(1)).double()
    f, cov = la.joint_predictive(x)
    assert f.shape == (2, 3, 4, outputs)
    assert cov.shape == (2, 3, 4 * outputs, 4 * outputs)
    for i in range(2):
        for j in range(3):
            f_ij, cov_ij = la(x[i, j], joint=True)
            torch.testing.assert_close(f[i, j].flatten(), f_ij, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(cov[i, j], cov_ij, rtol=1e-10, atol=1e-14)


def test_one_q_batch_without_batch_axes():
    la = _posterior(2, "dual")
    x = torch.randn(5, 2, dtype=torch.float64)
    f, cov = la.joint_predictive(x)
    assert f.shape == (5, 2) and cov.shape == (10, 10)


def test_gradient_in_x_against_central_differences():
    la = _posterior(2, "dual")
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: la.joint_predictive(z), (x,))


def test_inputs_without_a_q_axis_are_refused():
    la = _posterior(1, "network")
    with pytest.raises(InvalidInputError, match="q"):
        la.joint_predictive(torch.randn(2, dtype=torch.float64))
    with pytest.raises(InvalidInputError, match="q"):
        la.joint_predictive(torch.randn(3, 4, dtype=torch.float64))
