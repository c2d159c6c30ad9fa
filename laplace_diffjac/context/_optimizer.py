"""Optimise context locations through the NTK: the likelihood-weighted Nyström gap.

For locations ``Z`` the objective is the Titsias (2009) trace term with the
prior-scaled GGN/NTK kernel ``k`` and the GGN likelihood Hessians ``Λₙ``::

    G(Z) = Σₙ tr(Λₙ (k(xₙ, xₙ) − k(xₙ, Z) K_ZZ⁻¹ k(Z, xₙ)))

It is the part of the training data's curvature that the Nyström approximation
through ``Z`` misses (zero when ``Z`` explains every training point), so it is the
natural loss for choosing the context points of a subset-of-data or DTC
(:mod:`laplace_diffjac.context`) linearised-Laplace posterior. It is
estimated without bias on minibatches (``N / b`` times the batch sum) and minimised
with Adam; Jacobians at ``Z`` stay graph-connected (``enable_backprop=True``), the
Gram and its Cholesky factor are formed in float64.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from ..backends import BackendSpec, JacobianBackend, as_backend
from ..kernels import (
    PriorPrecision,
    flat_gram,
    jacobians,
    jittered_cholesky,
    n_jacobian_columns,
    output_hessians,
    prior_variance,
)
from ._data import Data, collect
from ._init import initial_locations

__all__ = [
    "LocationHistory",
    "LocationResult",
    "nystrom_gap",
    "optimize_locations",
]


@dataclass
class LocationHistory:
    """What happened while optimising.

    Attributes
    ----------
    objective : list of float
        Minibatch estimate of the Nyström gap at every step.
    time : list of float
        Seconds since the start at every step.
    initial_objective, final_objective : float
        The gap on the whole data set before and after optimising.
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


def nystrom_gap(
    backend: JacobianBackend,
    x: torch.Tensor,
    locations: torch.Tensor,
    hessians: torch.Tensor,
    prior_precision: PriorPrecision = 1.0,
    n_data: int | None = None,
    jitter: float = 1e-6,
    chunk_size: int = 256,
    x_jacobians: torch.Tensor | None = None,
) -> torch.Tensor:
    """Likelihood-weighted Nyström gap of a batch, differentiable w.r.t. ``Z``.

    ``Σₙ tr(Λₙ (k(xₙ, xₙ) − k(xₙ, Z) K_ZZ⁻¹ k(Z, xₙ)))``, optionally scaled by
    ``N / b``. Every summand is non-negative, so the minibatch estimate has a small
    variance. The Jacobians of ``x`` are detached (the result is differentiable
    with respect to ``Z`` and, through ``J(Z)``, the parameters); those of ``Z``
    are computed once.

    Parameters
    ----------
    backend : laplace.curvature.CurvatureInterface
        Jacobian backend (see :func:`laplace_diffjac.kernels.ntk`).
    x : torch.Tensor
        Training inputs ``(b, *input_shape)``.
    locations : torch.Tensor
        ``Z``, ``(M, *input_shape)``; may require grad.
    hessians : torch.Tensor
        ``Λₙ`` of the batch, ``(b, C, C)``
        (:func:`laplace_diffjac.kernels.output_hessians`).
    prior_precision : float or torch.Tensor, default=1.0
        Scalar or per-parameter prior precision.
    n_data : int, optional
        Size ``N`` of the whole data set: the batch sum is scaled by ``N / b``
        (an unbiased estimate for a uniformly drawn batch). ``None``: no scaling.
    jitter : float, default=1e-6
        Added to ``K_ZZ``'s diagonal, relative to its mean diagonal entry.
    chunk_size : int, default=256
        Inputs of ``x`` whose Jacobians are materialised at once.
    x_jacobians : torch.Tensor, optional
        The Jacobians ``(b, C, P)`` of ``x`` if already known (they do not depend
        on ``Z``); they are then not recomputed.

    Returns
    -------
    torch.Tensor
        Scalar, float64.

    """
    f64 = torch.float64
    M = locations.shape[0]
    J_z = jacobians(backend, locations).to(f64)
    prior_var = prior_variance(prior_precision, J_z.shape[-1], J_z)
    C = J_z.shape[1]
    L = jittered_cholesky(flat_gram(J_z, J_z, prior_var), jitter)
    gap = torch.zeros((), dtype=f64, device=L.device)
    known = (
        torch.split(x_jacobians, chunk_size)
        if x_jacobians is not None
        else [None] * len(torch.split(x, chunk_size))
    )
    for xc, lam, J_x in zip(
        torch.split(x, chunk_size), torch.split(hessians, chunk_size), known
    ):
        b = xc.shape[0]
        if J_x is None:
            J_x = jacobians(backend, xc, enable_backprop=False)
        J_x = J_x.detach().to(f64)
        lam = lam.to(f64)
        K_nn = torch.einsum("bcp,bep->bce", J_x * prior_var, J_x)
        K_zx = flat_gram(J_z, J_x, prior_var)
        V = torch.linalg.solve_triangular(L, K_zx, upper=False).reshape(M * C, b, C)
        explained = torch.einsum("kbc,bce,kbe->", V, lam, V)
        gap = gap + torch.einsum("bce,bce->", lam, K_nn) - explained
    return gap * (n_data / x.shape[0]) if n_data is not None else gap


def _hessians(
    model: nn.Module, x: torch.Tensor, likelihood: str, sigma_noise: Any, temp: float
) -> torch.Tensor:
    with torch.no_grad():
        f = model(x)
    return output_hessians(f, likelihood, sigma_noise, temp)


class _TrainingCache:
    """What does not depend on ``Z``: ``Λₙ`` and (if they fit) ``J(xₙ)``, once."""

    def __init__(
        self,
        backend: JacobianBackend,
        model: nn.Module,
        X: torch.Tensor,
        likelihood: str,
        lik: tuple,
        cache_jacobians: bool | None,
        chunk_size: int,
        device: torch.device,
    ) -> None:
        self.X = X
        with torch.no_grad():
            self.hessians = torch.cat(
                [
                    _hessians(model, xc.to(device), likelihood, *lik)
                    for xc in torch.split(X, chunk_size)
                ]
            )
        C = self.hessians.shape[-1]
        n_params = n_jacobian_columns(backend)
        size = X.shape[0] * C * n_params * X.element_size()
        if cache_jacobians is None:
            cache_jacobians = size <= _JACOBIAN_CACHE_BYTES
        self.jacobians: torch.Tensor | None = None
        if cache_jacobians:
            with torch.no_grad():
                self.jacobians = torch.cat(
                    [
                        jacobians(backend, xc.to(device), enable_backprop=False)
                        for xc in torch.split(X, chunk_size)
                    ]
                )

    def batch(self, idx: torch.Tensor | slice, device: torch.device) -> tuple:
        J = None if self.jacobians is None else self.jacobians[idx]
        return self.X[idx].to(device), self.hessians[idx], J


_JACOBIAN_CACHE_BYTES = 512 * 2**20


def _full_gap(
    backend: JacobianBackend,
    cache: _TrainingCache,
    Z: torch.Tensor,
    kwargs: dict[str, Any],
    batch_size: int,
) -> float:
    total = 0.0
    N = cache.X.shape[0]
    with torch.no_grad():
        for start in range(0, N, batch_size):
            xb, lam, J = cache.batch(slice(start, start + batch_size), Z.device)
            total += float(
                nystrom_gap(backend, xb, Z, lam, x_jacobians=J, **kwargs["gap"])
            )
    return total


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
        in ``N``) and minibatches are drawn from them.
    m : int
        Number of locations ``M``.
    init : {'kmeans', 'random'} or torch.Tensor, default='kmeans'
        Initialisation strategy or initial locations ``(M, *input_shape)``.
    backend : type or backend instance, optional
        Jacobian backend; default ``DiffBackPackGGN``.
    prior_precision : float or torch.Tensor, default=1.0
        Scalar or per-parameter prior precision (the kernel is ``J Σ₀ Jᵀ``).
    sigma_noise : float or torch.Tensor, default=1.0
        Observation noise for regression.
    temperature : float, default=1.0
        Likelihood temperature.
    steps : int, default=200
        Maximum number of Adam steps.
    lr : float, optional
        Adam learning rate; default ``0.05`` times the inputs' mean standard
        deviation per feature.
    batch_size : int, default=256
        Minibatch size over the training inputs.
    patience : int, default=50
        Stop after this many steps without a relative improvement of ``rel_tol``
        in the smoothed (EMA) objective; ``0`` disables early stopping.
    rel_tol : float, default=1e-4
        Relative improvement that counts.
    jitter : float, default=1e-6
        Relative diagonal jitter of ``K_ZZ``.
    seed : int, default=0
        Seeds initialisation and minibatch order.
    progress_bar : bool, default=True
        Show a tqdm progress bar.
    chunk_size : int, default=256
        Inputs whose Jacobians are materialised at once.
    cache_jacobians : bool, optional
        Compute the training inputs' Jacobians ``(N, C, P)`` once and reuse them
        at every step (they do not depend on ``Z``; only ``J(Z)`` is recomputed).
        ``None``: cache when they take at most 512 MiB. The likelihood Hessians
        ``Λₙ`` are always computed once.

    Returns
    -------
    LocationResult
        ``locations`` ``(M, *input_shape)`` (detached, on the model's device) and
        the history.

    """
    param = next(iter(model.parameters()))
    device, dtype = param.device, param.dtype
    X, _ = collect(data)
    X = X.to(dtype)
    N = X.shape[0]
    gen = torch.Generator().manual_seed(seed)
    Z0 = initial_locations(X, m, init, gen).to(device)
    backend = as_backend(model, likelihood, backend)
    kwargs = {
        "lik": (sigma_noise, temperature),
        "gap": {
            "prior_precision": prior_precision,
            "jitter": jitter,
            "chunk_size": chunk_size,
        },
    }
    if lr is None:
        lr = 0.05 * float(X.reshape(N, -1).std(dim=0).mean().clamp_min(1e-8))
    history = LocationHistory()
    cache = _TrainingCache(
        backend,
        model,
        X,
        likelihood,
        kwargs["lik"],
        cache_jacobians,
        chunk_size,
        device,
    )
    history.initial_objective = _full_gap(backend, cache, Z0, kwargs, batch_size)

    Z = Z0.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([Z], lr=lr)
    b = min(batch_size, N)
    order = torch.randperm(N, generator=gen)
    cursor, best, ema, since_best = 0, math.inf, None, 0
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="Locations", disable=not progress_bar)
    for _ in bar:
        if cursor + b > N:
            order, cursor = torch.randperm(N, generator=gen), 0
        xb, lam, J_x = cache.batch(order[cursor : cursor + b], device)
        cursor += b
        loss = nystrom_gap(
            backend, xb, Z, lam, n_data=N, x_jacobians=J_x, **kwargs["gap"]
        )
        (grad,) = torch.autograd.grad(loss, Z)
        Z.grad = grad
        optimizer.step()
        value = float(loss.detach())
        history.objective.append(value)
        history.time.append(time.perf_counter() - start)
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        bar.set_postfix(objective=f"{value:.4g}")
        if math.isinf(best) or ema < best - rel_tol * abs(best):
            best, since_best = ema, 0
        else:
            since_best += 1
        if patience and since_best >= patience:
            history.stopped_early = True
            break
    bar.close()
    locations = Z.detach()
    history.final_objective = _full_gap(backend, cache, locations, kwargs, batch_size)
    return LocationResult(locations, history)
