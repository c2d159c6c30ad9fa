"""Initial context locations: a random subset of the inputs, or k-means centres."""

from __future__ import annotations

from numbers import Integral

import torch

from ...errors import InvalidInputError

__all__ = [
    "check_init",
    "check_init_size",
    "initial_locations",
    "kmeans",
    "random_subset",
]

STRATEGIES = ("random", "kmeans")


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
    InvalidInputError
        For ``m`` outside ``[1, N]``, an unknown strategy or a tensor of the
        wrong shape (a ``ValueError``).

    """
    check_init(x, m, init)
    if isinstance(init, torch.Tensor):
        return init.detach().to(device=x.device, dtype=x.dtype).clone()
    if init == "random":
        return random_subset(x, m, generator)
    return kmeans(x, m, generator)


def check_init(x: torch.Tensor, m: int, init: object) -> None:
    """Raise unless ``m`` and ``init`` fit the inputs ``x``.

    Parameters
    ----------
    x : torch.Tensor
        Inputs ``(N, *input_shape)``.
    m : int
        Number of locations.
    init : object
        ``'random'``, ``'kmeans'`` or locations ``(m, *input_shape)``.

    Raises
    ------
    InvalidInputError
        Naming ``m`` or ``init`` and what is accepted.

    """
    check_init_size(x.shape[0], tuple(x.shape[1:]), m, init)


def check_init_size(
    n: int, feature_shape: tuple[int, ...], m: int, init: object
) -> None:
    """:func:`check_init` from the data set's size ``N`` and feature shape.

    Parameters
    ----------
    n : int
        Number of inputs ``N`` (over all shards).
    feature_shape : tuple of int
        ``input_shape``.
    m : int
        Number of locations.
    init : object
        ``'random'``, ``'kmeans'`` or locations ``(m, *input_shape)``.

    Raises
    ------
    InvalidInputError
        Naming ``m`` or ``init`` and what is accepted.

    """
    _check_m_n(n, m)
    if isinstance(init, torch.Tensor):
        if init.shape != (m, *feature_shape):
            raise InvalidInputError(
                f"init (the initial locations) must have shape {(m, *feature_shape)} "
                f"(m inputs of the data's feature shape), got {tuple(init.shape)}."
            )
    elif not isinstance(init, str) or init not in STRATEGIES:
        raise InvalidInputError(
            f"init must be 'random', 'kmeans' or a tensor of locations, got {init!r}."
        )


def _check_m(x: torch.Tensor, m: int) -> None:
    _check_m_n(x.shape[0], m)


def _check_m_n(n: int, m: int) -> None:
    if isinstance(m, bool) or not isinstance(m, Integral) or not 1 <= m <= n:
        raise InvalidInputError(
            f"m (the number of locations) must be an integer with 1 <= m <= N = "
            f"{n}, got {m!r}."
        )
