"""Detection and selective-prediction metrics against scikit-learn and brute force."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from sklearn.metrics import roc_auc_score

from studies.real.metrics import accuracy_coverage, aurc, auroc, entropy


def test_auroc_equals_scikit_learn_with_ties() -> None:
    gen = torch.Generator().manual_seed(0)
    score = torch.randint(0, 5, (60,), generator=gen).double()  # many ties
    positive = torch.rand(60, generator=gen) < 0.4
    want = roc_auc_score(positive.numpy(), score.numpy())
    assert auroc(score, positive) == pytest.approx(want, abs=1e-12)
    continuous = torch.randn(60, generator=gen)
    want = roc_auc_score(positive.numpy(), continuous.numpy())
    assert auroc(continuous, positive) == pytest.approx(want, abs=1e-12)


def test_auroc_by_hand() -> None:
    positive = torch.tensor([True, True, False, False])
    assert auroc(torch.tensor([3.0, 2.0, 1.0, 0.0]), positive) == 1.0
    assert auroc(torch.tensor([0.0, 1.0, 2.0, 3.0]), positive) == 0.0
    assert auroc(torch.zeros(4), positive) == 0.5
    # pairs (pos, neg): (2,2) tie 0.5, (2,1) 1, (0,2) 0, (0,1) 0 -> 1.5 / 4
    assert auroc(torch.tensor([2.0, 0.0, 2.0, 1.0]), positive) == 0.375
    with pytest.raises(ValueError, match="both positives and negatives"):
        auroc(torch.ones(3), torch.ones(3, dtype=torch.bool))


def _brute_force(uncertainty: list[float], correct: list[bool]) -> tuple[float, list]:
    """AURC and per-k accuracy averaged over every order sorted by ``uncertainty``."""
    n = len(uncertainty)
    orders = [
        p
        for p in itertools.permutations(range(n))
        if all(uncertainty[p[i]] <= uncertainty[p[i + 1]] for i in range(n - 1))
    ]
    areas, accs = [], []
    for p in orders:
        wrong = [0.0 if correct[i] else 1.0 for i in p]
        cum = list(itertools.accumulate(wrong))
        areas.append(sum(cum[k] / (k + 1) for k in range(n)) / n)
        accs.append([1 - cum[k] / (k + 1) for k in range(n)])
    return sum(areas) / len(areas), [
        sum(a[k] for a in accs) / len(accs) for k in range(n)
    ]


def test_aurc_and_accuracy_coverage_against_every_tie_order() -> None:
    u = [0.1, 0.3, 0.3, 0.3, 0.7, 0.2]
    c = [True, False, True, True, False, False]
    area, acc_k = _brute_force(u, c)
    ut, ct = torch.tensor(u), torch.tensor(c)
    assert aurc(ut, ct) == pytest.approx(area, abs=1e-12)
    coverages = tuple(k / 6 for k in range(1, 7))
    assert accuracy_coverage(ut, ct, coverages) == pytest.approx(acc_k, abs=1e-12)


def test_aurc_by_hand() -> None:
    correct = torch.tensor([True, False, True, True])
    # kept in order 0, 2, 3, 1: risks 0, 0, 0, 1/4
    assert aurc(torch.tensor([0.0, 9.0, 1.0, 2.0]), correct) == pytest.approx(1 / 16)
    assert aurc(torch.zeros(4), correct) == pytest.approx(0.25)  # error rate
    assert accuracy_coverage(torch.zeros(4), correct, (0.5, 1.0)) == [0.75, 0.75]


def test_entropy_by_hand() -> None:
    probs = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    assert torch.allclose(entropy(probs), torch.tensor([math.log(2), 0.0]).double())
