"""Shifted test inputs: pixel noise and rotations of digits, tabular range shift.

Digits are corrupted as 8×8 images of raw pixel values (0–16), *before*
standardisation with the training statistics; the tabular data sets' standardised
test inputs are moved beyond the training range. Severity 0 is the clean test set.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import ndimage

from .data import Split

__all__ = [
    "SEVERITIES",
    "beyond_range",
    "gaussian_noise",
    "rotate_images",
    "shifted_test_sets",
]

#: Severities per corruption (pixel-noise std in pixel units of 0–16, degrees,
#: multiples of each feature's training range).
SEVERITIES: dict[str, tuple[float, ...]] = {
    "noise": (0.0, 2.0, 4.0, 8.0),
    "rotation": (0.0, 15.0, 30.0, 45.0),
    "range": (0.0, 0.25, 0.5, 1.0),
}
PIXEL_RANGE = (0.0, 16.0)


def gaussian_noise(raw: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """Raw pixels plus ``N(0, std²)`` noise, clipped to the pixel range 0–16.

    Parameters
    ----------
    raw : torch.Tensor
        ``(n, 64)`` raw pixel values.
    std : float
        Noise standard deviation in pixel units.
    seed : int
        Seed of the noise.

    Returns
    -------
    torch.Tensor
        ``(n, 64)`` float64.

    """
    gen = torch.Generator().manual_seed(40_000 + seed)
    noise = torch.randn(raw.shape, generator=gen, dtype=torch.float64)
    return (raw.double() + std * noise).clamp(*PIXEL_RANGE)


def rotate_images(raw: torch.Tensor, degrees: float, side: int = 8) -> torch.Tensor:
    """Each ``side × side`` image rotated about its centre (``scipy.ndimage.rotate``).

    Bilinear interpolation, the image size kept, zeros (background) outside.

    Parameters
    ----------
    raw : torch.Tensor
        ``(n, side²)`` raw pixel values, row-major images.
    degrees : float
        Counter-clockwise angle.
    side : int, default=8
        Image side.

    Returns
    -------
    torch.Tensor
        ``(n, side²)`` float64.

    """
    images = raw.double().numpy().reshape(-1, side, side)
    turned = ndimage.rotate(
        images, degrees, axes=(2, 1), reshape=False, order=1, mode="constant", cval=0.0
    )
    return torch.from_numpy(np.ascontiguousarray(turned).reshape(raw.shape[0], -1))


def beyond_range(
    x: torch.Tensor, x_train: torch.Tensor, severity: float, seed: int
) -> torch.Tensor:
    """Inputs moved by ``severity`` times each feature's training range.

    Feature ``j`` moves by ``s_j · severity · (max_j − min_j)`` of the training
    inputs, with a random sign ``s_j = ±1`` per feature (seeded); at severity 1
    every input lies outside the training range in every non-constant feature.

    Parameters
    ----------
    x, x_train : torch.Tensor
        ``(n, D)`` test and ``(N, D)`` training inputs (standardised).
    severity : float
        Multiple of the range.
    seed : int
        Seed of the signs.

    Returns
    -------
    torch.Tensor
        ``(n, D)``, dtype of ``x``.

    """
    gen = torch.Generator().manual_seed(50_000 + seed)
    signs = torch.randint(0, 2, (x.shape[1],), generator=gen).to(x.dtype) * 2 - 1
    span = x_train.max(dim=0).values - x_train.min(dim=0).values
    return x + severity * signs * span.to(x.dtype)


def shifted_test_sets(
    split: Split, seed: int
) -> dict[str, list[tuple[float, torch.Tensor]]]:
    """The corrupted test inputs of a split, per corruption and severity > 0.

    Parameters
    ----------
    split : Split
        With ``x_test_raw`` and the training statistics (``load_split``).
    seed : int
        Seed of noise and signs.

    Returns
    -------
    dict
        ``{corruption: [(severity, standardised inputs (n, D)), ...]}``; digits:
        ``noise`` and ``rotation``, the tabular sets: ``range``.

    """
    if split.name != "digits":
        return {
            "range": [
                (s, beyond_range(split.x_test, split.x_train, s, seed))
                for s in SEVERITIES["range"][1:]
            ]
        }
    if split.x_test_raw is None:
        raise ValueError("The digits split needs x_test_raw (use load_split).")
    raw = split.x_test_raw
    return {
        "noise": [
            (s, split.standardise(gaussian_noise(raw, s, seed)))
            for s in SEVERITIES["noise"][1:]
        ],
        "rotation": [
            (s, split.standardise(rotate_images(raw, s)))
            for s in SEVERITIES["rotation"][1:]
        ],
    }
