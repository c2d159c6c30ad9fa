"""Metrics of the study against hand computations or scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from studies.real.metrics import (
    accuracy,
    ece,
    gaussian_nlpd,
    log_var_error,
    nlpd,
    rmse,
    share_below,
)
from studies.real.predictive import probit


def test_nlpd_accuracy_by_hand() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.5, 0.4, 0.1]])
    y = torch.tensor([0, 2, 1])
    assert nlpd(probs, y) == pytest.approx(
        -(math.log(0.7) + math.log(0.6) + math.log(0.4)) / 3
    )
    assert accuracy(probs, y) == pytest.approx(2 / 3)


def test_gaussian_nlpd_and_rmse_against_scipy() -> None:
    f64 = torch.float64
    mean = torch.tensor([[0.5], [-1.0], [2.0]], dtype=f64)
    var = torch.tensor([[0.25], [2.0], [1.0]], dtype=f64)
    y = torch.tensor([[0.0], [0.5], [2.5]], dtype=f64)
    ref = -stats.norm.logpdf(y.numpy(), mean.numpy(), np.sqrt(var.numpy())).mean()
    assert gaussian_nlpd(mean, var, y) == pytest.approx(float(ref), rel=1e-12)
    assert rmse(mean, y) == pytest.approx(math.sqrt((0.25 + 2.25 + 0.25) / 3))


def test_ece_by_hand() -> None:
    # top-label confidences 0.95, 0.92, 0.55, 0.52, 0.31 (classes 0,0,1,1,2)
    probs = torch.tensor(
        [
            [0.95, 0.03, 0.02],  # bin 10, correct
            [0.92, 0.05, 0.03],  # bin 10, wrong
            [0.20, 0.55, 0.25],  # bin 6, correct
            [0.28, 0.52, 0.20],  # bin 6, wrong
            [0.34, 0.35, 0.31],  # bin 4, top label 1 with 0.35, wrong
        ]
    )
    y = torch.tensor([0, 1, 1, 0, 2])
    bin10 = 2 / 5 * abs(0.5 - (0.95 + 0.92) / 2)
    bin6 = 2 / 5 * abs(0.5 - (0.55 + 0.52) / 2)
    bin4 = 1 / 5 * abs(0.0 - 0.35)
    assert ece(probs, y) == pytest.approx(bin10 + bin6 + bin4, rel=1e-6)
    perfect = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert ece(perfect, torch.tensor([0, 1])) == 0.0


def test_log_var_error_and_share_below_by_hand() -> None:
    full = torch.tensor([[1.0, 2.0], [4.0, 0.5]])
    var = torch.tensor([[math.e, 2.0], [4.0 / math.e**2, 0.5]])
    assert log_var_error(var, full) == pytest.approx((1 + 0 + 2 + 0) / 4)
    assert share_below(var, full) == pytest.approx(1 / 4)


def test_probit_by_hand() -> None:
    f = torch.tensor([[1.0, -1.0]])
    var = torch.tensor([[8 / math.pi, 0.0]])  # kappa = 1/sqrt(2), 1
    logits = torch.tensor([1 / math.sqrt(2), -1.0])
    assert torch.allclose(probit(f, var)[0], logits.double().softmax(0))
