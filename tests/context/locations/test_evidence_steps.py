"""optimize_locations(objective="evidence"): wiring, improvement, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from laplace_diffjac import (
    ContextPosterior,
    DiffBackPackGGN,
    InvalidInputError,
    optimize_locations,
)
from laplace_diffjac.context import evidence_loss_backward
from tests.conftest import CASES

MLP = CASES[0]  # mlp-C1, float64


def _data():
    x = MLP.inputs(30, seed=4)
    with torch.no_grad():
        y = MLP.model()(x) + 0.1 * torch.randn(30, 1, dtype=torch.float64)
    return x, y


def test_steps_equal_adam_on_the_evidence_by_hand():
    """Three steps in Z, log δ, log σ equal a hand-written Adam loop (1e-12)."""
    model, (x, y) = MLP.model(), _data()
    Z0 = x[:4].clone()
    result = optimize_locations(
        model, "regression", (x, y), 4, init=Z0, steps=3, lr=0.05,
        prior_precision=2.0, sigma_noise=0.3, objective="evidence",
        learn_hyperparameters=True, progress_bar=False, patience=0,
    )  # fmt: skip
    backend = DiffBackPackGGN(model, "regression")
    Z = Z0.clone().requires_grad_()
    log_prec = torch.tensor(math.log(2.0), dtype=torch.float64, requires_grad=True)
    log_sigma = torch.tensor(math.log(0.3), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam(
        [{"params": [Z], "lr": 0.05}, {"params": [log_prec, log_sigma], "lr": 0.1}]
    )
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        losses.append(
            float(
                evidence_loss_backward(
                    backend,
                    Z,
                    (x, y),
                    "regression",
                    log_prec.exp(),
                    log_sigma.exp(),
                    jitter=1e-6,
                    inputs=[Z, log_prec, log_sigma],
                )  # fmt: skip
            )
        )
        optimizer.step()
    torch.testing.assert_close(result.locations, Z.detach(), rtol=1e-12, atol=1e-12)
    assert result.prior_precision == pytest.approx(math.exp(log_prec.item()), rel=1e-12)
    assert result.sigma_noise == pytest.approx(math.exp(log_sigma.item()), rel=1e-12)
    assert result.history.objective == pytest.approx(losses, rel=1e-12)


def test_the_bound_improves_and_the_result_carries_the_hyperparameters():
    model, (x, y) = MLP.model(), _data()
    Z0 = x[:3].clone()

    def bound(Z, prior, sigma):
        cp = ContextPosterior(model, "regression", Z, sigma_noise=sigma)
        cp.prior_precision = prior
        return float(cp.fit((x, y)).log_marginal_likelihood())

    result = optimize_locations(
        model, "regression", (x, y), 3, init=Z0, steps=25, lr=0.05,
        objective="evidence", learn_hyperparameters=True, progress_bar=False,
    )  # fmt: skip
    before = bound(Z0, 1.0, 1.0)
    after = bound(result.locations, result.prior_precision, result.sigma_noise)
    assert after > before + 1.0, (before, after)
    assert result.history.objective[-1] < result.history.objective[0]


def test_locations_only_keeps_the_hyperparameters():
    model, (x, y) = MLP.model(), _data()
    result = optimize_locations(
        model, "regression", (x, y), 3,
        init=x[:3].clone(), steps=2, objective="evidence", prior_precision=3.0,
        sigma_noise=0.5, progress_bar=False,
    )  # fmt: skip
    assert result.prior_precision == 3.0 and result.sigma_noise == 0.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"objective": "likelihood"}, "objective must be one of"),
        ({"learn_hyperparameters": True}, "needs objective='evidence'"),
        (
            {"objective": "evidence", "prior_precision": torch.ones(52)},
            "scalar prior_precision",
        ),
    ],
)
def test_bad_objective_arguments(kwargs, message):
    model, (x, y) = MLP.model(), _data()
    with pytest.raises(InvalidInputError, match=message):
        optimize_locations(model, "regression", (x, y), 3, progress_bar=False, **kwargs)
