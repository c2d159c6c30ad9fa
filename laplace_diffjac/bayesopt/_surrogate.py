"""The pieces of a retraining: the network, the locations, the tuned posterior.

The network is trained as laplace-bayesopt's ``LaplaceBoTorch`` trains it (Adam
with weight decay, cosine learning-rate schedule over all steps, mean squared
error, shuffled minibatches), so that the two surrogates see comparable networks.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..backends import BackendSpec
from ..context import ContextPosterior, optimize_locations
from ..errors import InvalidInputError
from ..laplace_integration import kron_evidence_hyperparameters

__all__ = [
    "SurrogateSettings",
    "choose_locations",
    "finetune_network",
    "fit_posterior",
    "kron_hyperparameters",
    "locations_are_observations",
    "posterior_mean_kind",
    "train_network",
]

LOCATION_KINDS = ("observations", "optimised", "random")
PREDICTIVE_MEANS = ("dual", "network", "residual")
EVIDENCES = ("exact", "kron")
OUTCOME_STATISTICS = ("training", "initial")


@dataclass(frozen=True)
class SurrogateSettings:
    """Everything a retraining needs besides the data (given once, kept on update).

    Attributes are the keywords of :class:`~laplace_diffjac.bayesopt.ContextBoTorch`
    of the same names (documented there).
    """

    get_net: Callable[[], nn.Module]
    noise_var: float | str | None
    n_epochs: int
    lr: float
    wd: float
    batch_size: int
    n_locations: int
    locations: str
    bounds: torch.Tensor | None
    location_steps: int
    n_domain: int
    posthoc_marglik_iters: int
    backend: BackendSpec
    seed: int
    predictive_mean: str = "network"
    structured: bool = False
    evidence: str = "kron"
    outcome_statistics: str = "training"

    def __post_init__(self) -> None:
        if self.locations not in LOCATION_KINDS:
            raise InvalidInputError(
                "locations must be 'observations', 'optimised' or 'random', got "
                f"{self.locations!r}."
            )
        if self.predictive_mean not in PREDICTIVE_MEANS:
            raise InvalidInputError(
                "predictive_mean must be 'residual', 'dual' or 'network', got "
                f"{self.predictive_mean!r}."
            )
        if self.evidence not in EVIDENCES:
            raise InvalidInputError(
                f"evidence must be 'exact' or 'kron', got {self.evidence!r}."
            )
        if self.outcome_statistics not in OUTCOME_STATISTICS:
            raise InvalidInputError(
                "outcome_statistics must be 'training' or 'initial', got "
                f"{self.outcome_statistics!r}."
            )
        for name in ("n_epochs", "batch_size", "n_locations", "n_domain"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(
                    f"{name} must be a positive int, got {value!r}."
                )
        for name in ("location_steps", "posthoc_marglik_iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInputError(f"{name} must be an int >= 0, got {value!r}.")
        noise = self.noise_var
        if (
            noise is not None
            and noise != "residuals"
            and not (
                isinstance(noise, (int, float))
                and not isinstance(noise, bool)
                and math.isfinite(noise)
                and noise > 0
            )
        ):
            raise InvalidInputError(
                "noise_var must be a positive number, 'residuals' (the network's "
                "mean squared residual) or None (learned by the evidence), got "
                f"{noise!r}."
            )


def train_network(
    s: SurrogateSettings, X: torch.Tensor, Y: torch.Tensor, generator: torch.Generator
) -> nn.Module:
    """A fresh ``s.get_net()`` trained on ``(X, Y)``, in eval mode.

    Parameters
    ----------
    s : SurrogateSettings
        Training settings.
    X : torch.Tensor
        ``(N, d)`` transformed inputs.
    Y : torch.Tensor
        ``(N, K)`` transformed targets.
    generator : torch.Generator
        Shuffles the minibatches (the network's initialisation uses PyTorch's
        global generator, as laplace-bayesopt's).

    Returns
    -------
    torch.nn.Module

    Raises
    ------
    InvalidInputError
        If the network's parameters are not in the data's dtype and on its device,
        or its output has another number of columns than ``Y``.

    """
    net = s.get_net()
    param = next(iter(net.parameters()))
    if param.dtype != X.dtype or param.device != X.device:
        raise InvalidInputError(
            f"get_net() returns a network in {param.dtype} on {param.device}, the "
            f"observations are {X.dtype} on {X.device}; return the network in the "
            "observations' dtype and device (BoTorch works in float64: .double())."
        )
    _train(net, X, Y, s.n_epochs, s.lr, s, generator)
    with torch.no_grad():
        if net(X[:1]).shape[-1] != Y.shape[-1]:
            raise InvalidInputError(
                f"get_net()'s network has {net(X[:1]).shape[-1]} outputs, the "
                f"observations {Y.shape[-1]} columns; they must agree."
            )
    return net


def finetune_network(
    s: SurrogateSettings,
    net: nn.Module,
    X: torch.Tensor,
    Y: torch.Tensor,
    epochs: int,
    generator: torch.Generator,
) -> nn.Module:
    """A copy of ``net`` trained further on ``(X, Y)`` for ``epochs`` epochs.

    Warm-started from the current weights with a fresh Adam at a tenth of the
    training's learning rate (cosine schedule over the fine-tuning's steps), so
    that the network learns the observations that arrived since it was trained
    without leaving the minimum it is in.

    Parameters
    ----------
    s : SurrogateSettings
        Training settings.
    net : torch.nn.Module
        The current network (not modified).
    X, Y : torch.Tensor
        ``(N, d)`` and ``(N, K)`` transformed observations, the new ones included.
    epochs : int
        Passes over ``(X, Y)``.
    generator : torch.Generator
        Shuffles the minibatches.

    Returns
    -------
    torch.nn.Module
        In eval mode.

    """
    tuned = copy.deepcopy(net)
    _train(tuned, X, Y, epochs, s.lr * FINETUNE_LR_FACTOR, s, generator)
    return tuned


#: Fine-tuning's learning rate relative to the training's.
FINETUNE_LR_FACTOR = 0.1


def _train(
    net: nn.Module,
    X: torch.Tensor,
    Y: torch.Tensor,
    epochs: int,
    lr: float,
    s: SurrogateSettings,
    generator: torch.Generator,
) -> None:
    """Adam with weight decay and a cosine schedule on the mean squared error.

    Shuffled minibatches of ``s.batch_size`` (the last one smaller), as a
    shuffling ``DataLoader`` draws them, indexed directly: a loader collates
    each minibatch sample by sample, a noticeable share of a step for the small
    networks and data of BO.
    """
    n = X.shape[0]
    steps_per_epoch = -(-n // s.batch_size)
    optimizer = _adam(list(net.parameters()), lr, s.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, max(epochs * steps_per_epoch, 1)
    )
    loss_fn = nn.MSELoss()
    net.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator).to(X.device)
        for batch in order.split(s.batch_size):
            optimizer.zero_grad()
            loss = loss_fn(net(X[batch]), Y[batch])
            loss.backward()
            optimizer.step()
            scheduler.step()
    net.eval()
    for p in net.parameters():
        p.grad = None


def _adam(
    params: list[torch.Tensor], lr: float, weight_decay: float
) -> torch.optim.Adam:
    """Adam with PyTorch's fused kernel where it runs on the parameters' device.

    The same update as the default (per-tensor) implementation, in one kernel
    per step instead of about ten per parameter: for the small networks of BO,
    whose steps are dominated by per-operation overhead, this takes about a
    quarter off each training step (median 0.71 against 0.97 ms, d-50-50-1,
    batch 10, one thread). Releases without a fused CPU kernel (before PyTorch
    2.4) refuse it; they get the multi-tensor (``foreach``) implementation.

    Returns
    -------
    torch.optim.Adam
    """
    try:
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, fused=True)
    except RuntimeError:
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, foreach=True)


def locations_are_observations(s: SurrogateSettings, n_observations: int) -> bool:
    """Whether the locations are the observations themselves (exact posterior).

    Returns
    -------
    bool

    """
    return s.locations == "observations" and n_observations <= s.n_locations


def _box(s: SurrogateSettings, X: torch.Tensor) -> torch.Tensor:
    """``(2, d)`` lower and upper bounds of the locations' domain."""
    if s.bounds is not None:
        return s.bounds.to(X)
    return torch.stack([X.min(0).values, X.max(0).values])


def choose_locations(
    s: SurrogateSettings, net: nn.Module, X: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """``(M, d)`` context locations for the trained network.

    ``'observations'``: ``X`` itself while ``N <= s.n_locations`` (the DTC
    posterior is then the exact GP posterior of the linearised network), else as
    ``'optimised'``. ``'random'``: uniform in the bounds. ``'optimised'``: those,
    moved by ``optimize_locations`` (the Nyström gap, ``s.location_steps``
    steps) on the observations together with ``s.n_domain`` uniform points of
    the bounds, so
    that the locations serve the whole domain where later observations and the
    acquisition's queries fall, not only the observations so far. The gap's
    minimiser does not depend on a scalar ``δ`` or ``σ`` (they scale it), so
    it runs before the hyperparameters are tuned.

    Returns
    -------
    torch.Tensor

    """
    if locations_are_observations(s, X.shape[0]):
        return X.clone()
    lo, hi = _box(s, X)
    d = X.shape[-1]
    uniform = torch.rand(s.n_locations, d, generator=generator, dtype=X.dtype)
    Z = lo + (hi - lo) * uniform.to(X.device)
    if s.locations == "random" or s.location_steps == 0:
        return Z
    domain = torch.rand(s.n_domain, d, generator=generator, dtype=X.dtype)
    data = torch.cat([X, lo + (hi - lo) * domain.to(X.device)])
    result = optimize_locations(
        net,
        "regression",
        data,
        s.n_locations,
        init=Z,
        backend=s.backend,
        steps=s.location_steps,
        progress_bar=False,
        seed=s.seed,
    )
    return torch.minimum(torch.maximum(result.locations, lo), hi)


def fit_posterior(
    s: SurrogateSettings,
    net: nn.Module,
    Z: torch.Tensor,
    X: torch.Tensor,
    Y: torch.Tensor,
    hyperparameters: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ContextPosterior:
    """The context posterior on ``(X, Y)``, ``δ``/``σ`` tuned or given.

    ``δ`` and (with ``noise_var=None``) ``σ`` maximise an evidence (Adam,
    ``s.posthoc_marglik_iters`` steps, as laplace-bayesopt's post-hoc tuning):
    with ``s.evidence == 'exact'`` the context posterior's bound (exact when the
    locations are the observations) with the prior mean ``μ₀ = 0``, with
    ``'kron'`` laplace-torch's KFAC Laplace evidence
    (:func:`kron_hyperparameters`) (``noise_var='residuals'``:
    ``σ²`` is the network's mean squared residual on ``(X, Y)``, its
    maximum-likelihood noise, and only ``δ`` is tuned), unless ``hyperparameters``
    (prior precision, ``σ``) are given: a refit between trainings keeps those
    of the last training. With ``s.predictive_mean == 'residual'`` the returned
    posterior has the prior centred at the trained weights, ``μ₀ = θ*``, so that
    its dual mean is the network plus the GP's correction of its residuals
    (the evidence is not tuned there: without the ``‖θ* − μ₀‖²`` term it would
    send ``δ`` to infinity).

    Returns
    -------
    ContextPosterior

    """
    if hyperparameters is None and s.evidence == "kron":
        hyperparameters = kron_hyperparameters(s, net, X, Y)
    if hyperparameters is None:
        tuned = _posterior(s, net, Z, X, Y, centred=False)
        if s.posthoc_marglik_iters > 0:
            tuned.optimize_prior_precision(
                method="marglik",
                n_steps=s.posthoc_marglik_iters,
                learn_sigma_noise=s.noise_var is None,
            )
        if s.predictive_mean != "residual":
            return tuned
        hyperparameters = (tuned.prior_precision, tuned.sigma_noise)
    posterior = _posterior(s, net, Z, X, Y, centred=s.predictive_mean == "residual")
    posterior.prior_precision, posterior.sigma_noise = hyperparameters
    return posterior


def kron_hyperparameters(
    s: SurrogateSettings, net: nn.Module, X: torch.Tensor, Y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``δ`` and ``σ`` that maximise laplace-torch's KFAC Laplace evidence.

    laplace-bayesopt's ``LaplaceBoTorch`` choice
    (:func:`~laplace_diffjac.laplace_integration.kron_evidence_hyperparameters`:
    a ``KronLaplace`` of ``net`` on minibatches of ``s.batch_size``, then
    ``s.posthoc_marglik_iters`` Adam steps on ``log δ`` and ``log σ`` from 1).
    KFAC's log-determinant is not the exact one: this evidence prefers a smaller
    ``σ`` and a larger ``δ`` than the exact evidence on the same network
    (``benchmarks/bayesopt/SAME_NETWORK.md``). With ``noise_var`` set, ``σ`` is
    that value and only ``δ`` is tuned.

    Returns
    -------
    tuple of torch.Tensor
        Prior precision ``(1,)`` and ``σ`` ``(1,)``, detached.

    """
    sigma = None if s.noise_var is None else _initial_sigma(s, net, X, Y)
    return kron_evidence_hyperparameters(
        net, X, Y, s.batch_size, s.posthoc_marglik_iters, sigma
    )


def posterior_mean_kind(s: SurrogateSettings) -> str:
    """The :class:`ContextPosterior` ``predictive_mean`` for ``s.predictive_mean``.

    ``'residual'`` is the posterior's dual mean with its prior centred at the
    trained weights.

    Returns
    -------
    str

    """
    return "network" if s.predictive_mean == "network" else "dual"


def _initial_sigma(
    s: SurrogateSettings, net: nn.Module, X: torch.Tensor, Y: torch.Tensor
) -> float:
    """``σ`` given (``noise_var``), the residuals' root mean square, or 1."""
    if s.noise_var is None:
        return 1.0
    if s.noise_var == "residuals":
        with torch.no_grad():
            mse = float(((net(X) - Y) ** 2).mean())
        return math.sqrt(max(mse, NOISE_FLOOR))
    return math.sqrt(float(s.noise_var))


#: The smallest ``σ²`` that ``noise_var='residuals'`` takes (standardised units).
NOISE_FLOOR = 1e-6


def _posterior(
    s: SurrogateSettings,
    net: nn.Module,
    Z: torch.Tensor,
    X: torch.Tensor,
    Y: torch.Tensor,
    centred: bool,
) -> ContextPosterior:
    """A fitted posterior; ``centred``: its prior mean at the trained weights."""
    sigma = _initial_sigma(s, net, X, Y)
    posterior = ContextPosterior(
        net,
        "regression",
        Z,
        sigma_noise=sigma,
        backend=s.backend,
        enable_backprop=True,
        predictive_mean=posterior_mean_kind(s),
        structured=s.structured,
    )
    if centred:
        posterior.prior_mean = posterior.mean.clone()
    return posterior.fit((X, Y))
