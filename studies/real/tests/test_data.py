"""Splits: 70/15/15, standardised on the training part, disjoint, seeded, stratified."""

from __future__ import annotations

import pytest
import torch

from studies.real.data import DATASETS, load_split


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_split_is_70_15_15_standardised_and_disjoint(name: str) -> None:
    s = load_split(name, 68)
    n = sum(t.shape[0] for t in (s.x_train, s.x_val, s.x_test))
    assert abs(s.x_test.shape[0] - 0.15 * n) <= 1
    assert abs(s.x_val.shape[0] - 0.15 * n) <= 1
    assert torch.allclose(s.x_train.mean(0), torch.zeros(1), atol=1e-5)
    sd = s.x_train.std(0, unbiased=False)
    assert torch.all(((sd - 1).abs() < 1e-4) | (sd == 0))
    rows = {tuple(r.tolist()) for r in s.x_train}
    assert not any(tuple(r.tolist()) in rows for r in s.x_test)
    again = load_split(name, 68)
    assert torch.equal(again.x_test, s.x_test)
    assert not torch.equal(load_split(name, 117).x_test, s.x_test)
    if s.task == "classification":
        for part in (s.y_val, s.y_test):
            share = torch.bincount(part, minlength=s.n_outputs) / part.numel()
            train = torch.bincount(s.y_train, minlength=s.n_outputs) / s.y_train.numel()
            assert torch.all((share - train).abs() < 0.03)
