"""Corrupted test inputs: rotations, pixel noise, range shift, held-out classes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage

from studies.real.corruptions import (
    SEVERITIES,
    beyond_range,
    gaussian_noise,
    rotate_images,
    shifted_test_sets,
)
from studies.real.data import load_split


def test_rotation_by_quarter_turns_is_exact() -> None:
    images = torch.rand(3, 64, dtype=torch.float64)
    grid = images.numpy().reshape(3, 8, 8)
    for k in (1, 2, 3):
        want = np.rot90(grid, k, axes=(1, 2)).reshape(3, 64)
        got = rotate_images(images, 90.0 * k).numpy()
        assert np.allclose(got, want, atol=1e-12)
    assert torch.allclose(rotate_images(images, 0.0), images)


def test_rotation_matches_scipy_per_image() -> None:
    images = torch.rand(2, 64, dtype=torch.float64) * 16
    got = rotate_images(images, 30.0)
    for i in range(2):
        one = ndimage.rotate(
            images[i].numpy().reshape(8, 8), 30.0, reshape=False, order=1
        )
        assert np.allclose(got[i].numpy(), one.reshape(64), atol=1e-12)


def test_noise_is_seeded_clipped_and_of_its_scale() -> None:
    raw = torch.full((400, 64), 8.0, dtype=torch.float64)
    noisy = gaussian_noise(raw, 2.0, seed=1)
    assert torch.equal(noisy, gaussian_noise(raw, 2.0, seed=1))
    assert not torch.equal(noisy, gaussian_noise(raw, 2.0, seed=2))
    assert abs(float((noisy - 8).std()) - 2.0) < 0.05
    big = gaussian_noise(raw, 50.0, seed=1)
    assert float(big.min()) == 0.0 and float(big.max()) == 16.0
    assert torch.equal(gaussian_noise(raw, 0.0, seed=1), raw)


def test_beyond_range_leaves_the_training_range() -> None:
    x_train = torch.randn(100, 5)
    x = torch.randn(30, 5).clamp(-1, 1)
    lo, hi = x_train.min(0).values, x_train.max(0).values
    moved = beyond_range(x, x_train, 1.0, seed=3)
    assert torch.all((moved < lo) | (moved > hi))
    shift = (moved - x)[0]
    assert torch.allclose(shift.abs(), hi - lo)
    assert torch.equal(beyond_range(x, x_train, 0.0, seed=3), x)


def test_digits_sets_are_corrupted_before_standardisation() -> None:
    split = load_split("digits", 68)
    assert split.x_test_raw is not None
    assert torch.allclose(split.standardise(split.x_test_raw), split.x_test, atol=1e-5)
    sets = shifted_test_sets(split, 68)
    assert [s for s, _ in sets["rotation"]] == list(SEVERITIES["rotation"][1:])
    want = split.standardise(rotate_images(split.x_test_raw, 15.0))
    assert torch.equal(sets["rotation"][0][1], want)
    assert set(shifted_test_sets(load_split("wine", 68), 68)) == {"range"}


def test_held_out_classes() -> None:
    full = load_split("digits", 68)
    part = load_split("digits", 68, keep_classes=(0, 1, 2, 3, 4))
    assert part.n_outputs == 5 and int(part.y_train.max()) == 4
    assert part.x_ood is not None and part.y_ood is not None
    assert set(part.y_ood.tolist()) == {5, 6, 7, 8, 9}
    assert part.x_test.shape[0] + part.x_ood.shape[0] == full.x_test.shape[0]
    assert torch.allclose(part.x_train.mean(0), torch.zeros(1), atol=1e-5)
    with pytest.raises(ValueError, match="keep_classes must be 0..K-1"):
        load_split("digits", 68, keep_classes=(1, 2))
