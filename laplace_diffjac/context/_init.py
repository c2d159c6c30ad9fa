"""Initial context locations: a random subset of the inputs, or k-means centres."""

from __future__ import annotations

import torch

__all__ = ["initial_locations", "kmeans", "random_subset"]


def random_subset(
    x: torch.Tensor, m: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw ``m`` distinct inputs uniformly at random.

    Parameters
    ----------
    x : torch.Tensor
        Inputs ``(N, *input_shape)``.
    m : int
        Number of locations, ``1 <= m <= N``.
    generator : torch.Generator, optional
        CPU generator for reproducibility.

    Returns
    -------
    torch.Tensor
        ``(m, *input_shape)``, a copy.

    """
    _check_m(x, m)
    idx = torch.randperm(x.shape[0], generator=generator)[:m]
    return x[idx.to(x.device)].clone()


def kmeans(
    x: torch.Tensor,
    m: int,
    generator: torch.Generator | None = None,
    iterations: int = 25,
) -> torch.Tensor:
    """K-means centres (k-means++ seeding, then Lloyd iterations) of the inputs.

    Parameters
    ----------
    x : torch.Tensor
        Inputs ``(N, *input_shape)``; flattened per input for the distances.
    m : int
        Number of centres, ``1 <= m <= N``.
    generator : torch.Generator, optional
        CPU generator for the seeding.
    iterations : int, default=25
        Lloyd iterations.

    Returns
    -------
    torch.Tensor
        ``(m, *input_shape)``.

    """
    _check_m(x, m)
    flat = x.detach().reshape(x.shape[0], -1).to(torch.float64)
    first = torch.randint(flat.shape[0], (1,), generator=generator)
    centres = flat[first.to(flat.device)]
    for _ in range(1, m):
        d2 = torch.cdist(flat, centres).min(dim=1).values.square()
        probs = (d2 / d2.sum()).cpu() if d2.sum() > 0 else None
        if probs is None:
            pick = torch.randint(flat.shape[0], (1,), generator=generator)
        else:
            pick = torch.multinomial(probs, 1, generator=generator)
        centres = torch.cat([centres, flat[pick.to(flat.device)]])
    for _ in range(iterations):
        assign = torch.cdist(flat, centres).argmin(dim=1)
        sums = torch.zeros_like(centres).index_add_(0, assign, flat)
        counts = torch.bincount(assign, minlength=m).to(flat.dtype)
        filled = counts > 0
        centres[filled] = sums[filled] / counts[filled, None]
    return centres.to(x.dtype).reshape(m, *x.shape[1:])


def initial_locations(
    x: torch.Tensor,
    m: int,
    init: str | torch.Tensor = "kmeans",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Initial locations by name (``'random'``, ``'kmeans'``) or as given.

    Parameters
    ----------
    x : torch.Tensor
        Inputs ``(N, *input_shape)``.
    m : int
        Number of locations.
    init : {'random', 'kmeans'} or torch.Tensor, default='kmeans'
        Strategy, or the locations ``(m, *input_shape)`` themselves.
    generator : torch.Generator, optional
        CPU generator for the random strategies.

    Returns
    -------
    torch.Tensor
        ``(m, *input_shape)``, detached, on ``x``'s device and dtype.

    Raises
    ------
    ValueError
        For an unknown strategy or a tensor of the wrong shape.

    """
    if isinstance(init, torch.Tensor):
        if init.shape != (m, *x.shape[1:]):
            raise ValueError(
                f"Given locations must have shape {(m, *x.shape[1:])}, "
                f"got {tuple(init.shape)}."
            )
        return init.detach().to(device=x.device, dtype=x.dtype).clone()
    if init == "random":
        return random_subset(x, m, generator)
    if init == "kmeans":
        return kmeans(x, m, generator)
    raise ValueError(f"init must be 'random', 'kmeans' or a tensor, got {init!r}.")


def _check_m(x: torch.Tensor, m: int) -> None:
    if not 1 <= m <= x.shape[0]:
        raise ValueError(f"Need 1 <= m <= N = {x.shape[0]}, got m = {m}.")
