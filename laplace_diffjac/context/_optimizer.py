"""Optimise context locations: minimise the Nyström gap with Adam on minibatches.

The objective is :func:`laplace_diffjac.context.nystrom_gap`. Everything that does
not depend on the locations (``Λₙ``, ``tr(Λₙ k(xₙ, xₙ))`` and, when they fit, the
training inputs' kernel pieces) is computed once (:mod:`._training_cache`); a step
costs the locations' side of the kernel, ``K_ZZ``, ``K_Zb`` for a minibatch of
``b`` inputs and one Cholesky factorisation of ``K_ZZ``, whatever ``N`` is.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from ..backends import BackendSpec, as_backend
from ..kernels import PriorPrecision
from ._checks import check_finite, check_fits_model, check_like_model, check_likelihood
from ._data import Data, collect
from ._init import check_init, initial_locations
from ._objective import batch_gap
from ._routes import Route, make_route
from ._settings import LocationSettings, resolve_settings
from ._training_cache import TrainingCache, training_hessians

__all__ = ["LocationHistory", "LocationResult", "optimize_locations"]


@dataclass
class LocationHistory:
    """What happened while optimising.

    Attributes
    ----------
    objective : list of float
        Minibatch estimate of the Nyström gap at every step.
    time : list of float
        Seconds since the start of the steps at every step.
    initial_objective, final_objective : float
        The gap on the whole data set before and after optimising; NaN unless
        ``evaluate_full=True`` (it costs two passes over all ``N`` inputs).
    stopped_early : bool
        Whether early stopping ended the run before ``steps``.

    """

    objective: list[float] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    initial_objective: float = math.nan
    final_objective: float = math.nan
    stopped_early: bool = False


@dataclass
class LocationResult:
    """Optimised locations ``(M, *input_shape)`` and the :class:`LocationHistory`."""

    locations: torch.Tensor
    history: LocationHistory


def optimize_locations(
    model: nn.Module,
    likelihood: str,
    data: Data,
    m: int,
    init: str | torch.Tensor = "kmeans",
    backend: BackendSpec = None,
    prior_precision: PriorPrecision = 1.0,
    sigma_noise: float | torch.Tensor = 1.0,
    temperature: float = 1.0,
    steps: int = 200,
    lr: float | None = None,
    batch_size: int = 256,
    patience: int = 50,
    rel_tol: float = 1e-4,
    jitter: float = 1e-6,
    seed: int = 0,
    progress_bar: bool = True,
    chunk_size: int = 256,
    cache_jacobians: bool | None = None,
    evaluate_full: bool = False,
    structured: bool | None = None,
    settings: LocationSettings | None = None,
) -> LocationResult:
    """Choose ``M`` context locations that minimise the likelihood-weighted Nyström gap.

    Parameters
    ----------
    model : torch.nn.Module
        The trained network (MAP); it is not changed.
    likelihood : {'regression', 'classification'}
        Determines ``Λₙ`` (see :func:`laplace_diffjac.kernels.output_hessians`).
    data : DataLoader, torch.Tensor or tuple
        Training data: a loader of ``(x, y)`` batches, inputs ``(N, ...)`` or
        ``(x, y)``. Only the inputs are used; they are gathered once (memory linear
        in ``N``), cast to the model's dtype, and minibatches are drawn from them.
    m : int
        Number of locations ``M``, ``1 <= M <= N``.
    init : {'kmeans', 'random'} or torch.Tensor, default='kmeans'
        Initialisation strategy or initial locations ``(M, *input_shape)`` in the
        model's dtype and on its device.
    backend : type or backend instance, optional
        Jacobian backend; default ``DiffBackPackGGN``.
    prior_precision : float or torch.Tensor, default=1.0
        Scalar or per-parameter prior precision (the kernel is ``J Σ₀ Jᵀ``).
    sigma_noise : float or torch.Tensor, default=1.0
        Observation noise for regression.
    temperature : float, default=1.0
        Likelihood temperature.
    steps, lr, batch_size, patience, rel_tol, jitter, seed, progress_bar, \
chunk_size, cache_jacobians, evaluate_full, structured
        The optimiser's options, documented in :class:`LocationSettings`
        (defaults ``200, None, 256, 50, 1e-4, 1e-6, 0, True, 256, None, False,
        None``).
    settings : LocationSettings, optional
        The same options as one object; then leave the keywords above at their
        defaults.

    Returns
    -------
    LocationResult
        ``locations`` ``(M, *input_shape)`` (detached, on the model's device) and
        the history.

    Raises
    ------
    InvalidInputError
        Before any work starts: for an unknown likelihood, an option out of
        range, ``m`` outside ``[1, N]``, an unknown ``init``, non-finite inputs or
        locations, inputs or locations the model does not accept, or locations
        in another dtype or on another device than the model.
    ValueError
        For an invalid prior precision, or ``structured=True`` where the
        structured route does not apply.

    """
    options = dict(
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        patience=patience,
        rel_tol=rel_tol,
        jitter=jitter,
        seed=seed,
        progress_bar=progress_bar,
        chunk_size=chunk_size,
        cache_jacobians=cache_jacobians,
        evaluate_full=evaluate_full,
        structured=structured,
    )
    s = resolve_settings(settings, options)
    check_likelihood(likelihood)
    X = _checked_inputs(model, data, m, init)
    device = next(model.parameters()).device
    Z0 = initial_locations(X, m, init, torch.Generator().manual_seed(s.seed))
    route = make_route(
        as_backend(model, likelihood, backend), prior_precision, s.structured, device
    )
    lam = training_hessians(
        model, X, likelihood, sigma_noise, temperature, s.chunk_size
    )
    cache = TrainingCache(route, X, lam, s.cache_jacobians, s.chunk_size)
    return _optimise(route, cache, Z0.to(device), s)


def _checked_inputs(
    model: nn.Module, data: Data, m: int, init: str | torch.Tensor
) -> torch.Tensor:
    """The training inputs in the model's dtype, after every check on the inputs."""
    X, _ = collect(data)
    check_finite(X, "data")
    check_init(X, m, init)
    if isinstance(init, torch.Tensor):
        check_like_model(init, "init", model)
        check_finite(init, "init")
    X = X.to(next(model.parameters()).dtype)
    check_fits_model(X, "data", model)
    return X


def _optimise(
    route: Route, cache: TrainingCache, Z0: torch.Tensor, s: LocationSettings
) -> LocationResult:
    history = LocationHistory()
    if s.evaluate_full:
        history.initial_objective = _full_gap(route, cache, Z0, s)
    lr = s.lr if s.lr is not None else _default_lr(cache.X)
    Z = Z0.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([Z], lr=lr)
    batches = _Minibatches(len(cache), s.batch_size, s.seed)
    stopper = _EarlyStopping(s.patience, s.rel_tol)
    start = time.perf_counter()
    bar = tqdm(range(s.steps), desc="Locations", disable=not s.progress_bar)
    for _ in bar:
        pieces, lam, trace = cache.batch(batches.next())
        loss = batch_gap(
            route, route.pieces(Z, graph=True), pieces, lam, trace, s.jitter
        ) * (len(cache) / len(trace))
        (Z.grad,) = torch.autograd.grad(loss, Z)
        optimizer.step()
        value = float(loss.detach())
        history.objective.append(value)
        history.time.append(time.perf_counter() - start)
        bar.set_postfix(objective=f"{value:.4g}")
        if stopper.stop(value):
            history.stopped_early = True
            break
    bar.close()
    locations = Z.detach()
    if s.evaluate_full:
        history.final_objective = _full_gap(route, cache, locations, s)
    return LocationResult(locations, history)


def _default_lr(X: torch.Tensor) -> float:
    """``0.05`` times the inputs' mean standard deviation per feature."""
    std = (
        X.reshape(X.shape[0], -1).std(dim=0).mean()
        if X.shape[0] > 1
        else X.new_ones(())
    )
    return 0.05 * float(std.clamp_min(1e-8))


def _full_gap(
    route: Route, cache: TrainingCache, Z: torch.Tensor, s: LocationSettings
) -> float:
    total = 0.0
    with torch.no_grad():
        z_pieces = route.pieces(Z, graph=False)
        for start in range(0, len(cache), s.batch_size):
            pieces, lam, trace = cache.batch(slice(start, start + s.batch_size))
            total += float(batch_gap(route, z_pieces, pieces, lam, trace, s.jitter))
    return total


def stream_seed(seed: int, stream: int) -> int:
    """A 63-bit seed for stream ``stream`` of ``seed`` (SplitMix64 finaliser).

    Stream 0 is not used: ``torch.Generator().manual_seed(seed)`` is the
    initialisation's stream, so a random subset drawn with it never shares its
    permutation with the minibatch order (stream 1).

    Parameters
    ----------
    seed : int
        The user's seed.
    stream : int
        Index of the stream, ``>= 1``.

    Returns
    -------
    int
        Seed in ``[0, 2⁶³)``.

    """
    mask = 2**64 - 1
    z = (seed + stream * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


class _Minibatches:
    """Uniform minibatches without replacement within a pass (own random stream)."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.b = n, min(batch_size, n)
        self.gen = torch.Generator().manual_seed(stream_seed(seed, 1))
        self.order, self.cursor = torch.randperm(n, generator=self.gen), 0

    def next(self) -> torch.Tensor:
        if self.cursor + self.b > self.n:
            self.order, self.cursor = torch.randperm(self.n, generator=self.gen), 0
        idx = self.order[self.cursor : self.cursor + self.b]
        self.cursor += self.b
        return idx


class _EarlyStopping:
    """Stop after ``patience`` steps without a relative improvement of the EMA."""

    def __init__(self, patience: int, rel_tol: float) -> None:
        self.patience, self.rel_tol = patience, rel_tol
        self.best, self.since_best = math.inf, 0
        self.ema: float | None = None

    def stop(self, value: float) -> bool:
        self.ema = value if self.ema is None else 0.9 * self.ema + 0.1 * value
        if math.isinf(self.best) or self.ema < self.best - self.rel_tol * abs(
            self.best
        ):
            self.best, self.since_best = self.ema, 0
        else:
            self.since_best += 1
        return bool(self.patience) and self.since_best >= self.patience
