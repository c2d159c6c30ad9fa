"""Optimise context locations: minimise the Nyström gap with Adam on minibatches.

The objective is :func:`laplace_diffjac.context.nystrom_gap`. One pass over the
data, in memory or streamed, gives ``N``, the initial locations and the learning
rate (:mod:`._sources`, :mod:`._scan`); the steps' minibatches then come from a
source: in memory, everything that does not depend on the locations (``Λₙ``,
``tr(Λₙ k(xₙ, xₙ))`` and, when they fit, the training inputs' kernel pieces) is
computed once (:mod:`._training_cache`); streamed (:mod:`._streaming`), it is
computed for each step's batch only. Under ``torch.distributed`` every rank
evaluates its part of the minibatch and the parts are all-reduced
(:mod:`._sharding`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..._progress import progress
from ...backends import BackendSpec, as_backend
from ...budget import get_memory_budget
from ...data import Data, all_reduce_sum, check_likelihood
from ...jacobians._model_guard import preserved_state
from ...kernels import PriorPrecision
from ._budgeted_step import (
    StepPlan,
    budgeted_gap,
    feature_chunk,
    plan_step,
    route_sizes,
)
from ._evidence_steps import check_objective, optimise_evidence
from ._gap import batch_gap
from ._minibatches import EarlyStopping, Source
from ._result import LocationHistory, LocationResult
from ._routes import Route, make_route
from ._settings import LocationSettings, resolve_settings
from ._sharding import sync_gradient
from ._sources import read_data

__all__ = ["SMALL_STEP", "optimize_locations", "step_threads"]

#: ``M·C`` up to which a step runs on one thread by default.
SMALL_STEP = 256


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
    settings: LocationSettings | None = None,
    objective: str = "gap",
    learn_hyperparameters: bool = False,
    **options: Any,
) -> LocationResult:
    """Choose ``M`` context locations that minimise the likelihood-weighted Nyström gap.

    Parameters
    ----------
    model : torch.nn.Module
        The trained network (MAP); it is not changed.
    likelihood : {'regression', 'classification'}
        Determines ``Λₙ`` (see :func:`laplace_diffjac.kernels.output_hessians`).
    data : DataLoader, torch.Tensor or tuple
        Training data (this rank's shard under ``torch.distributed``): a loader
        of ``(x, y)`` batches, inputs ``(N, ...)`` or ``(x, y)``. Only the inputs
        are used, cast to the model's dtype. In memory (the default for tensors
        and indexable loaders) they are gathered once (memory linear in ``N``)
        and minibatches are drawn from them; a streamed loader (see Notes) is
        never gathered.
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
    settings : LocationSettings, optional
        The optimiser's options as one object (default: ``LocationSettings()``);
        its fields are documented there.
    objective : {'gap', 'evidence'}, default='gap'
        ``'gap'``: the Nyström gap, minibatched without bias, no targets needed.
        ``'evidence'``: minus the context posterior's evidence bound (its trace
        correction is half the gap), exact on all data every step (two passes;
        needs targets and a scalar prior precision); see
        :mod:`laplace_diffjac.context.locations._evidence_steps`.
    learn_hyperparameters : bool, default=False
        With ``objective='evidence'``: also learn ``log δ`` and (regression)
        ``log σ``, starting from ``prior_precision`` and ``sigma_noise``; the
        result carries them.
    **options
        Any field of :class:`LocationSettings` by name, applied on top of
        ``settings`` (a keyword is never dropped): ``steps=200``, ``lr=None``,
        ``batch_size=256``, ``patience=50``, ``rel_tol=1e-4``, ``jitter=1e-6``,
        ``seed=0``, ``progress_bar=True``, ``chunk_size=256``,
        ``cache_jacobians=None``, ``evaluate_full=False``, ``structured=None``,
        ``stream=None``, ``max_inputs=10000``, ``threads=None``.

    Returns
    -------
    LocationResult
        ``locations`` ``(M, *input_shape)`` (detached, on the model's device) and
        the history.

    Raises
    ------
    InvalidInputError
        Before any work starts: for an unknown likelihood, an option out of
        range or unknown, ``m`` outside ``[1, N]``, an unknown ``init``,
        non-finite inputs or locations, inputs or locations the model does not
        accept, or locations in another dtype or on another device than the
        model.
    ValueError
        For an invalid prior precision, or ``structured=True`` where the
        structured route does not apply.

    Notes
    -----
    **One pass first.** In memory or streamed, one pass over the inputs gives
    ``N``, the default ``lr`` (per-feature mean and variance) and the initial
    locations: every input gets a uniform random key, ``'random'`` takes the
    ``m`` inputs with the smallest keys and ``'kmeans'`` runs k-means on the
    ``max(m, max_inputs)`` smallest (all inputs when ``N <= max_inputs``).

    **Streaming** (``settings.stream=True`` with a ``DataLoader``, or by default
    a loader over an ``IterableDataset``, which must be finite): each step's
    minibatch is the loader's next batch (the iterator restarts at its end),
    with ``Λₙ`` and the pieces computed for that batch only; the estimate is
    ``N / b`` times the batch sum (unbiased when the loader's batches are
    uniform draws, e.g. ``shuffle=True``). Memory holds one batch and the
    sample, never ``N``.

    **torch.distributed** (a process group is initialised, e.g. by
    ``torchrun``): ``data`` on each rank is that rank's shard; the shards in
    rank order form the data set (``N`` is the sum of their sizes; a shard may
    be empty). In memory, each step's minibatch is the same set of global
    indices the single-process run draws on the concatenated data; each rank
    evaluates the part it owns, and the partial objective and gradient in
    ``Z`` are all-reduced (summed) before the Adam step, so ``Z`` is identical
    on every rank and equal to the single-process result up to the order of
    floating-point sums. An input's key depends on its global index only, so
    ``'random'`` and ``'kmeans'`` start from the locations a single process
    draws; a given ``init`` must be equal on every rank (checked by a
    checksum). Early stopping and ``evaluate_full`` use the all-reduced
    objective, so every rank stops at the same step. Streamed, each rank
    draws its keys from its own stream and its batches from its own loader, and
    the objective is the sum over ranks scaled by ``N / b`` with the global
    ``N`` and batch size ``b``.

    """
    s = resolve_settings(settings, options)
    check_likelihood(likelihood)
    check_objective(objective, learn_hyperparameters, prior_precision)
    device = next(model.parameters()).device
    jacobian_backend = as_backend(model, likelihood, backend)
    route = make_route(jacobian_backend, prior_precision, s.structured, device)
    reading = read_data(model, data, m, init, s)
    Z0, lr = reading.initial, reading.lr
    if objective == "evidence":
        hyper = (prior_precision, sigma_noise, temperature)
        with step_threads(s.threads, Z0, model):
            return optimise_evidence(
                jacobian_backend, data, likelihood, Z0, lr, hyper,
                learn_hyperparameters, s,
            )  # fmt: skip
    hessian_args = (likelihood, sigma_noise, temperature, s.chunk_size)
    source = reading.source(model, route, hessian_args, s)
    with step_threads(s.threads, Z0, model):
        return _optimise(route, source, Z0, lr, s)


@contextmanager
def step_threads(
    threads: int | None, Z: torch.Tensor, model: nn.Module
) -> Iterator[None]:
    """PyTorch's threads for the steps (see ``LocationSettings.threads``).

    Parameters
    ----------
    threads : int, optional
        The setting; ``None`` decides by ``M·C`` (one forward on one location).
    Z : torch.Tensor
        The initial locations ``(M, ...)``.
    model : torch.nn.Module
        The network.

    Yields
    ------
    None
        With the threads set; the previous number is restored on exit.

    """
    if threads is None:
        with preserved_state(model), torch.no_grad():
            n_outputs = int(model(Z[:1]).shape[-1])
        threads = 1 if Z.shape[0] * n_outputs <= SMALL_STEP else None
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _optimise(
    route: Route, source: Source, Z0: torch.Tensor, lr: float, s: LocationSettings
) -> LocationResult:
    history = LocationHistory()
    sizes = route_sizes(route, Z0)
    budget = get_memory_budget(Z0.device)
    chunk = feature_chunk(sizes, s.chunk_size, budget)  # the sources' chunks
    left = max(budget - source.held_bytes, 0)  # the cached features stay
    # planned for the largest minibatch part the source serves (a loader's own)
    plan = plan_step(sizes, len(Z0), max(source.batch_size, 1), chunk, left)
    if s.evaluate_full:
        history.initial_objective = _full_gap(route, source, Z0, s, plan)
    Z = Z0.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([Z], lr=lr)
    stopper = EarlyStopping(s.patience, s.rel_tol)
    start = time.perf_counter()
    bar = progress(range(s.steps), desc="Locations", enabled=s.progress_bar)
    for _ in bar:
        part = source.next_local(plan.hold_batch)
        if part is None:
            loss, grad, b = Z.new_zeros((), dtype=torch.float64), torch.zeros_like(Z), 0
        else:
            pieces, lam, trace = part
            if plan.whole:
                # widened once, so the Grams' gradients meet in float64
                z_pieces = route.pieces(Z, graph=True).to(torch.float64)
                loss = batch_gap(route, z_pieces, pieces, lam, trace, s.jitter)
                (grad,) = torch.autograd.grad(loss, Z)
            else:
                loss, got = budgeted_gap(route, plan, Z, pieces, lam, trace, s.jitter)
                assert got is not None
                grad = got
            b = len(trace)
        value, Z.grad, _ = sync_gradient(loss, grad, b, source.n)
        optimizer.step()
        history.objective.append(value)
        history.time.append(time.perf_counter() - start)
        bar.set_postfix(objective=f"{value:.4g}", refresh=False)
        if stopper.stop(value):
            history.stopped_early = True
            break
    bar.close()
    locations = Z.detach()
    if s.evaluate_full:
        history.final_objective = _full_gap(route, source, locations, s, plan)
    return LocationResult(locations, history)


def _full_gap(
    route: Route, source: Source, Z: torch.Tensor, s: LocationSettings, plan: StepPlan
) -> float:
    """The gap over all ``N`` inputs (summed over ranks)."""
    total = torch.zeros((), dtype=torch.float64, device=Z.device)
    with torch.no_grad():
        if not plan.whole:
            for pieces, lam, trace in source.full_local(plan.hold_batch):
                gap, _ = budgeted_gap(
                    route, plan, Z, pieces, lam, trace, s.jitter, False
                )
                total += gap
            return float(all_reduce_sum(total.reshape(1)))
        z_pieces = route.pieces(Z, graph=False)
        for pieces, lam, trace in source.full_local():
            total += batch_gap(route, z_pieces, pieces, lam, trace, s.jitter)
    return float(all_reduce_sum(total.reshape(1)))
