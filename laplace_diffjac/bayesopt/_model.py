"""``ContextBoTorch``: a BoTorch model on the context posterior (dual updates)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from botorch.models.model import Model
from botorch.models.transforms.outcome import OutcomeTransform
from botorch.posteriors.gpytorch import GPyTorchPosterior
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from linear_operator.operators import DenseLinearOperator
from torch import nn

from ..backends import BackendSpec, DiffBackPackGGN
from ..context import ContextPosterior
from ..errors import InvalidInputError
from ._schedule import RetrainSchedule
from ._surrogate import (
    SurrogateSettings,
    choose_locations,
    finetune_network,
    fit_posterior,
    locations_are_observations,
    posterior_mean_kind,
    train_network,
)

__all__ = ["ContextBoTorch"]


@dataclass
class _Fit:
    """What one training produced, and what arrived since (shared by updates)."""

    posterior: ContextPosterior  # its model is the trained network
    evidence_per_point: float
    since_training: int  # observations
    updates_since_training: int  # calls of condition_on_observations
    trainings: int


class ContextBoTorch(Model):
    """BoTorch surrogate: the context posterior of a trained network.

    ``posterior(X)`` is the linearised network's GP through ``M`` context
    locations (:class:`~laplace_diffjac.ContextPosterior`): joint over each
    q-batch, differentiable in ``X`` through the graph-connected Jacobians. By
    default it has ``LaplaceBoTorch``'s mean (the network) and hyperparameters
    (``δ`` and ``σ`` by laplace-torch's KFAC evidence), and the exact GGN
    covariance (the locations are the observations) where ``LaplaceBoTorch``
    has KFAC's. ``condition_on_observations`` follows the ``retrain``
    schedule: a retraining (a fresh network on all observations, new locations,
    ``δ`` and ``σ`` by the evidence), or, in between, a fine-tuning of the
    network and a new fit of the posterior (the default), or a dual update (the
    new observations folded into the posterior's sums: mean and covariance
    move, the network does not; with ``predictive_mean='dual'`` the mean moves
    too). laplace-bayesopt's ``LaplaceBoTorch`` retrains on every update.

    Parameters
    ----------
    get_net : callable
        ``() -> nn.Module``, a freshly initialised network with ``K`` outputs, in
        ``train_X``'s dtype and on its device.
    train_X : torch.Tensor
        ``(N, d)`` inputs.
    train_Y : torch.Tensor
        ``(N, K)`` observations.
    input_transform : botorch InputTransform, optional
        Applied to every input (fitted on ``train_X`` at each training).
    outcome_transform : botorch OutcomeTransform, optional
        E.g. ``Standardize(m=K)``; fitted at each training (or only at the
        first, ``outcome_statistics='initial'``), fixed in between (new
        observations are transformed with the statistics of the training).
    noise_var : float or 'residuals', optional
        Observation-noise variance in the transformed outcome space;
        ``'residuals'``: at each training the trained network's mean squared
        residual on the observations (its maximum-likelihood noise); ``None``:
        learned by the evidence with ``δ``.
    n_epochs, lr, wd, batch_size
        Network training as laplace-bayesopt's (Adam, weight decay, cosine
        schedule; defaults 1000, 0.1, 1e-3, 10).
    n_locations : int, default=100
        Number ``M`` of context locations.
    locations : {'observations', 'optimised', 'random'}, default='observations'
        ``'observations'``: the observations themselves while there are at most
        ``M`` of them, so that the posterior is the exact GP of the linearised
        network on them (every new observation becomes a location: the
        posterior is fitted again, with the hyperparameters of the last
        training); beyond ``M``, as ``'optimised'``. ``'optimised'``: uniform
        points of ``bounds`` moved by ``optimize_locations`` (the Nyström gap)
        on the observations and ``n_domain`` uniform points. ``'random'``:
        uniform in ``bounds``.
    bounds : torch.Tensor, optional
        ``(2, d)`` box of the (transformed) inputs where locations go; default
        the box of the observations at each training.
    retrain : RetrainSchedule, default=RetrainSchedule()
        When to retrain from scratch (default every 10 updates: calls of
        ``condition_on_observations``, whatever their batch size) and how many
        epochs to fine-tune after each update in between (default 50);
        ``RetrainSchedule(every=None, finetune_epochs=0)``: dual updates only.
    location_steps : int, default=100
        Steps of the location optimiser.
    n_domain : int, default=512
        Uniform points of ``bounds`` in the optimiser's objective.
    posthoc_marglik_iters : int, default=100
        Adam steps of the evidence tuning of ``δ`` (and ``σ``).
    backend : type or backend instance, default=DiffBackPackGGN
        Jacobian backend.
    device : str or torch.device, optional
        Accepted for laplace-bayesopt's signature; must be ``train_X``'s device.
    seed : int, default=0
        Seeds the minibatches and the locations of every training (with the
        number of observations, so each training draws anew).
    predictive_mean : {'network', 'residual', 'dual'}, default='network'
        ``'network'``: the trained (or fine-tuned) network's output, as
        ``LaplaceBoTorch``. ``'residual'``: the network plus the linearised
        GP's correction of its residuals (the dual mean with the prior centred
        at the trained weights, ``δ`` and ``σ`` tuned with the prior at zero):
        the network far from the observations. ``'dual'``: the linearised
        network's GP posterior mean with the prior at zero; far from the
        observations it is ``f(x) − J(x) θ*``, not the network.
    structured : bool, default=False
        Compute the kernels from the per-layer factors
        (:class:`~laplace_diffjac.ContextPosterior`'s ``structured``) instead of
        the Jacobians. For a d-50-50-1 network a posterior call with its
        gradient costs the same either way at 5 or 20 points, and 1.7× (125
        points) to 2.9× (256) less with ``True``: large q-batches and raw-sample
        scoring (``docs/bayesopt.md``, many observations). The default keeps
        the benchmark's recorded runs reproducible. Either way, a network whose
        parameters are all plain ``nn.Linear``'s is predicted from its layers'
        inputs and signals under a scalar prior (the default), the same
        numbers at 0.75–0.93× the posterior call's time.
    outcome_statistics : {'training', 'initial'}, default='training'
        The outcome transform's statistics: those of the observations at each
        training, or those of the initial ones throughout (laplace-bayesopt's
        ``LaplaceBoTorch``, whose models pass their fitted transform on).
    evidence : {'kron', 'exact'}, default='kron'
        The evidence whose maximum gives ``δ`` and ``σ`` at each training:
        ``'kron'``, laplace-torch's KFAC Laplace evidence, as ``LaplaceBoTorch``
        tunes them; ``'exact'``, the context posterior's (the exact GGN
        evidence while the locations are the observations). On the same
        network the exact evidence picks a smaller ``δ`` (a wider prior) and a
        larger ``σ``, and BO then explores more and finds worse points
        (``benchmarks/bayesopt``).

    Raises
    ------
    InvalidInputError
        For inputs that are not ``(N, d)`` or observations not ``(N, K)``, a
        ``device`` other than the data's, or settings out of range.

    """

    def __init__(
        self,
        get_net: Callable[[], nn.Module],
        train_X: torch.Tensor,
        train_Y: torch.Tensor,
        input_transform: nn.Module | None = None,
        outcome_transform: OutcomeTransform | None = None,
        noise_var: float | str | None = None,
        n_epochs: int = 1000,
        lr: float = 1e-1,
        wd: float = 1e-3,
        batch_size: int = 10,
        n_locations: int = 100,
        locations: str = "observations",
        bounds: torch.Tensor | None = None,
        retrain: RetrainSchedule | None = None,
        location_steps: int = 100,
        n_domain: int = 512,
        posthoc_marglik_iters: int = 100,
        backend: BackendSpec = DiffBackPackGGN,
        device: str | torch.device | None = None,
        seed: int = 0,
        predictive_mean: str = "network",
        structured: bool = False,
        evidence: str = "kron",
        outcome_statistics: str = "training",
    ) -> None:
        super().__init__()
        _check_data(train_X, train_Y, device)
        self._settings = SurrogateSettings(
            get_net, noise_var, n_epochs, lr, wd, batch_size, n_locations, locations,
            bounds, location_steps, n_domain, posthoc_marglik_iters, backend, seed,
            predictive_mean, structured, evidence, outcome_statistics,
        )  # fmt: skip
        self._schedule = RetrainSchedule() if retrain is None else retrain
        self.orig_train_X, self.orig_train_Y = train_X, train_Y
        if input_transform is not None:
            self.input_transform = input_transform
        if outcome_transform is not None:
            self.outcome_transform = outcome_transform
        self._train()

    # -- training and updates ------------------------------------------------

    def _train(self) -> None:
        """Fit the transforms, train, choose locations, fit and tune.

        The transforms are copied first: models before this one (and the
        caller's objects) keep theirs.
        """
        s = self._settings
        X, Y = self.orig_train_X, self.orig_train_Y
        if hasattr(self, "input_transform"):
            self.input_transform = copy.deepcopy(self.input_transform)
            self.input_transform.train()
            X = self.input_transform(X)
            self.input_transform.eval()
        if hasattr(self, "outcome_transform"):
            self.outcome_transform = copy.deepcopy(self.outcome_transform)
            initial = s.outcome_statistics == "initial"
            if not (initial and hasattr(self, "_fit")):  # else keep the first's
                self.outcome_transform.train()
            Y, _ = self.outcome_transform(Y)
            self.outcome_transform.eval()
        self.train_X, self.train_Y = X.detach(), Y.detach()
        generator = torch.Generator().manual_seed(s.seed * 100_003 + X.shape[0])
        net = train_network(s, self.train_X, self.train_Y, generator)
        Z = choose_locations(s, net, self.train_X, generator)
        posterior = fit_posterior(s, net, Z, self.train_X, self.train_Y)
        previous = getattr(self, "_fit", None)
        self._fit = _Fit(
            posterior,
            _evidence_per_point(posterior),
            since_training=0,
            updates_since_training=0,
            trainings=1 if previous is None else previous.trainings + 1,
        )

    def condition_on_observations(
        self, X: torch.Tensor, Y: torch.Tensor, **kwargs: Any
    ) -> ContextBoTorch:
        """A new model with ``(X, Y)`` added: a dual update, or a retraining.

        Parameters
        ----------
        X : torch.Tensor
            ``(n, d)`` new inputs, untransformed.
        Y : torch.Tensor
            ``(n, K)`` their observations, untransformed.
        **kwargs
            Accepted for BoTorch's signature; a ``noise`` is refused.

        Returns
        -------
        ContextBoTorch
            This model is unchanged.

        Raises
        ------
        NotImplementedError
            For batched (fantasy) observations or observation noise.
        InvalidInputError
            For ``X`` or ``Y`` of the wrong shape, dtype or device.

        """
        if X.dim() != 2 or Y.dim() != 2:
            raise NotImplementedError(
                "ContextBoTorch conditions on (n, d) inputs and (n, K) observations; "
                f"got X {tuple(X.shape)}, Y {tuple(Y.shape)}. Batched fantasies "
                "(fantasize, knowledge gradient) are not supported."
            )
        if kwargs.get("noise") is not None:
            raise NotImplementedError(
                "Observation noise per point is not supported; set noise_var."
            )
        _check_data(X, Y, None, like=(self.orig_train_X, self.orig_train_Y))
        new = copy.copy(self)  # shares modules' dicts: replaced below, not mutated
        new._modules = dict(self._modules)
        new.orig_train_X = torch.cat([self.orig_train_X, X])
        new.orig_train_Y = torch.cat([self.orig_train_Y, Y])
        since = self._fit.since_training + X.shape[0]
        updates = self._fit.updates_since_training + 1
        if self._schedule.due_on_count(updates):
            new._train()
            return new
        X_t, Y_t = self._transformed(X, Y)
        new.train_X = torch.cat([self.train_X, X_t])
        new.train_Y = torch.cat([self.train_Y, Y_t])
        s, finetune = self._settings, self._schedule.finetune_epochs
        if finetune > 0 or locations_are_observations(s, len(new.train_X)):
            posterior = new._refit()
        else:
            posterior = _copy_posterior(self._fit.posterior, s)
            posterior.update(X_t, Y_t)
        new._fit = _Fit(
            posterior,
            self._fit.evidence_per_point,
            since,
            updates,
            self._fit.trainings,
        )
        schedule = self._schedule
        if schedule.evidence_drop is not None and schedule.due_on_evidence(
            _evidence_per_point(posterior), self._fit.evidence_per_point
        ):
            new._train()
        return new

    def _refit(self) -> ContextPosterior:
        """The posterior on all observations, between trainings.

        The network is fine-tuned first (``finetune_epochs > 0``), the locations
        become the observations (``locations='observations'`` while they fit) and
        the hyperparameters and transforms are those of the last training.

        Returns
        -------
        ContextPosterior

        """
        s, epochs = self._settings, self._schedule.finetune_epochs
        old = self._fit.posterior
        net = old.model
        if epochs > 0:
            seed = s.seed * 100_003 + len(self.train_X) + 7919
            generator = torch.Generator().manual_seed(seed)
            net = finetune_network(
                s, net, self.train_X, self.train_Y, epochs, generator
            )
        if locations_are_observations(s, len(self.train_X)):
            Z = self.train_X.clone()
        else:
            Z = old.locations
        hyperparameters = (old.prior_precision.clone(), old.sigma_noise.clone())
        return fit_posterior(s, net, Z, self.train_X, self.train_Y, hyperparameters)

    def _transformed(
        self, X: torch.Tensor, Y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if hasattr(self, "input_transform"):
            X = self.input_transform(X)
        if hasattr(self, "outcome_transform"):
            Y, _ = self.outcome_transform(Y)
        return X.detach(), Y.detach()

    # -- BoTorch's model interface -------------------------------------------

    def posterior(
        self,
        X: torch.Tensor,
        output_indices: list[int] | None = None,
        observation_noise: bool | torch.Tensor = False,
        posterior_transform: Callable | None = None,
        **kwargs: Any,
    ) -> GPyTorchPosterior:
        """The joint predictive over each q-batch of ``X``.

        Parameters
        ----------
        X : torch.Tensor
            ``(*batch, q, d)`` (``(q, d)``: one q-batch), untransformed.
        output_indices : list of int, optional
            Outputs to keep (default all ``K``).
        observation_noise : bool, default=False
            Add the observation noise ``σ²`` (of the outcomes, transformed).
        posterior_transform : callable, optional
            Applied last, as BoTorch's models do.
        **kwargs
            Accepted for BoTorch's signature.

        Returns
        -------
        GPyTorchPosterior
            A ``MultivariateNormal`` ``(*batch, q)`` for one output, else a
            ``MultitaskMultivariateNormal`` ``(*batch, q, K)`` (joint over
            ``q`` and the outputs); mean and covariance differentiable in ``X``.

        Raises
        ------
        NotImplementedError
            For a tensor of observation noise.

        """
        if isinstance(observation_noise, torch.Tensor):
            raise NotImplementedError(
                "observation_noise must be a bool; a tensor of noise levels is "
                "not supported."
            )
        X = self.transform_inputs(X) if hasattr(self, "input_transform") else X
        posterior = self._fit.posterior
        mean, cov = posterior.joint_predictive(X)  # (*b, q, K), (*b, qK, qK)
        if output_indices is not None:
            mean, cov = _select_outputs(mean, cov, output_indices)
        if observation_noise:
            noise = posterior.sigma_noise.to(cov) ** 2
            cov = cov + noise * torch.eye(cov.shape[-1], dtype=cov.dtype)
        # A linear operator, not a tensor: GPyTorch factorises it lazily with its
        # jittered Cholesky (a dense tensor is factorised here, exactly, and a
        # q-batch of near-duplicate points is singular up to rounding).
        lazy = DenseLinearOperator(cov)
        if mean.shape[-1] == 1:
            dist: MultivariateNormal = MultivariateNormal(mean[..., 0], lazy)
        else:
            dist = MultitaskMultivariateNormal(mean, lazy, interleaved=True)
        result = GPyTorchPosterior(dist)
        if hasattr(self, "outcome_transform"):
            transform = self.outcome_transform
            if output_indices is not None:
                transform = transform.subset_output(output_indices)
            result = transform.untransform_posterior(result)
        if posterior_transform is not None:
            return posterior_transform(result)
        return result

    @property
    def num_outputs(self) -> int:
        """The number ``K`` of outputs."""
        return int(self.orig_train_Y.shape[-1])

    @property
    def batch_shape(self) -> torch.Size:
        """No model batch: one network and one posterior."""
        return torch.Size([])

    @property
    def context_posterior(self) -> ContextPosterior:
        """The current :class:`~laplace_diffjac.ContextPosterior`."""
        return self._fit.posterior

    @property
    def net(self) -> nn.Module:
        """The trained network of the last training."""
        return self._fit.posterior.model

    @property
    def trainings(self) -> int:
        """How many times a network was trained for this model's history."""
        return self._fit.trainings

    @property
    def observations_since_training(self) -> int:
        """Observations folded in by dual updates since the last training."""
        return self._fit.since_training

    @property
    def updates_since_training(self) -> int:
        """Calls of ``condition_on_observations`` since the last training."""
        return self._fit.updates_since_training

    def _set_transformed_inputs(self) -> None:
        """No-op: the inputs are transformed here, at training and on update."""

    def _revert_to_original_inputs(self) -> None:
        """No-op (see :meth:`_set_transformed_inputs`)."""


def _check_data(
    X: torch.Tensor,
    Y: torch.Tensor,
    device: str | torch.device | None,
    like: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    if X.dim() != 2 or Y.dim() != 2 or X.shape[0] != Y.shape[0] or X.shape[0] == 0:
        raise InvalidInputError(
            f"Expected inputs (N, d) and observations (N, K) with N >= 1, got "
            f"{tuple(X.shape)} and {tuple(Y.shape)}; reshape Y to (N, 1) for one "
            "output."
        )
    if device is not None and torch.device(device) != X.device:
        raise InvalidInputError(
            f"device={device!r} but the data are on {X.device}; move train_X and "
            "train_Y (and the network) there instead."
        )
    if like is not None:
        X0, Y0 = like
        if X.shape[1] != X0.shape[1] or Y.shape[1] != Y0.shape[1]:
            raise InvalidInputError(
                f"New data {tuple(X.shape)}, {tuple(Y.shape)} do not match the "
                f"model's (N, {X0.shape[1]}) inputs and (N, {Y0.shape[1]}) outputs."
            )
        if X.dtype != X0.dtype or X.device != X0.device:
            raise InvalidInputError(
                f"New inputs are {X.dtype} on {X.device}, the model's {X0.dtype} "
                f"on {X0.device}; convert them."
            )


def _copy_posterior(
    posterior: ContextPosterior, s: SurrogateSettings
) -> ContextPosterior:
    """A posterior with the same sums and hyperparameters (the network shared)."""
    copied = ContextPosterior(
        posterior.model,
        "regression",
        posterior.locations,
        backend=s.backend,
        enable_backprop=True,
        predictive_mean=posterior_mean_kind(s),
        structured=s.structured,
    )
    copied.load_state_dict(posterior.state_dict())
    return copied


def _evidence_per_point(posterior: ContextPosterior) -> float:
    with torch.no_grad():
        return float(posterior.log_marginal_likelihood()) / posterior.n_data


def _select_outputs(
    mean: torch.Tensor, cov: torch.Tensor, indices: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep ``indices`` of the ``K`` outputs in ``(…, q, K)`` and ``(…, qK, qK)``."""
    q, K = mean.shape[-2:]
    keep = torch.tensor(indices, device=mean.device)
    flat = (torch.arange(q, device=mean.device)[:, None] * K + keep).flatten()
    return mean[..., keep], cov[..., flat[:, None], flat]
