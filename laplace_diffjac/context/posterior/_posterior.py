"""Linearised-Laplace posterior seeing all ``N`` points through ``M`` locations.

DTC / Nyström form with the GGN likelihood Hessian. With the prior-scaled NTK
``K = J Σ₀ Jᵀ``, locations ``Z`` and the GGN likelihood Hessians
``Λ = blockdiag(Λₙ)`` of all training points, the latent posterior covariance at
test inputs is::

    Σ** = K** − K*Z (K_ZZ⁻¹ − (K_ZZ + K_ZX Λ K_XZ)⁻¹) K_Z*

and the mean is the MAP network's output. ``fit`` accumulates ``K_ZX Λ K_XZ`` (per
prior group, without ``1 / (σ² T)``; ``_statistics``) batch by batch, all-reduced over
a ``torch.distributed`` group. With ``Z = X`` and an invertible ``K_XX``
this is the full-data GGN Laplace and ``log_marginal_likelihood`` its evidence,
else a lower bound (derivation in ``_evidence``). In float64, ``K_ZZ = L Lᵀ``,
``L⁻¹ (K_ZX Λ K_XZ) L⁻ᵀ = U diag(s) Uᵀ``, ``W = L⁻ᵀ U diag(√(s / (1 + s)))`` and
``Σ** = K** − (K*Z W)(K*Z W)ᵀ``: no inverse of ``Λ`` (singular for softmax). The
factor is rebuilt whenever a hyperparameter changed: never a stale answer.

The class owns everything a laplace-torch user calls on a Laplace object:
hyperparameters (validated as laplace-torch's setters do), the evidence and its
terms, ``optimize_prior_precision`` (:mod:`._tuning`), saving, and the predictive.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..._device_arithmetic import default_compute_dtype
from ...backends import BackendSpec, DiffBackPackGGN, as_backend
from ...budget import get_memory_budget
from ...data import (
    Data,
    TrainingData,
    check_fits_model,
    check_inputs,
    is_distributed,
)
from ...errors import InvalidInputError
from ...kernels import PriorPrecision
from ...kernels._feature_sizes import FeatureSizes, feature_sizes
from . import _tuning
from ._chunks import ChunkedFeatures, Chunks, plan_chunks
from ._context_predictive import ContextPredictive
from ._data_pass import accumulate, compute_copy, sync_copy
from ._dual_mean import check_predictive_mean
from ._evidence import evidence_terms, log_likelihood
from ._factor_cache import FactorCache
from ._features import (
    BatchFeatures,
    location_features,
)
from ._hyperparameters import (
    PriorGroups,
    check_prior_precision,
    check_sigma_noise,
    expand_precision,
    infer_structure,
    layer_sizes,
)
from ._linear_predictions import (
    LinearPredictions,
)
from ._state import load_posterior_state, posterior_state
from ._statistics import Accumulators, reduce_accumulators

__all__ = ["ContextPosterior"]


class ContextPosterior(ContextPredictive):
    """DTC linearised-Laplace posterior through context locations.

    Call it like a laplace-torch Laplace object: ``la(x)`` returns ``(mean, var)``
    for regression (latent variance without observation noise, as laplace-torch)
    and class probabilities for classification. ``log_marginal_likelihood``,
    ``optimize_prior_precision``, ``state_dict`` and ``load_state_dict`` work as
    laplace-torch's.

    Parameters
    ----------
    model : torch.nn.Module
        Trained network (MAP); not changed.
    likelihood : {'regression', 'classification'}
        The likelihood.
    locations : torch.Tensor
        Context locations ``Z``, ``(M, *input_shape)``, finite, in the model's dtype.
    sigma_noise : float or torch.Tensor, default=1.0
        Observation noise (regression); may be changed after ``fit``.
    prior_precision : float or torch.Tensor, default=1.0
        Scalar, layerwise ``(n_layers,)`` or per-parameter ``(P,)``.
    temperature : float, default=1.0
        Likelihood temperature; may be changed after ``fit``.
    backend : type or backend instance, default=DiffBackPackGGN
        Jacobian backend.
    enable_backprop : bool, default=False
        Keep predictions differentiable with respect to the test inputs.
    jitter : float, default=1e-8
        Diagonal jitter of ``K_ZZ`` relative to its mean diagonal entry.
    batch_size : int, default=256
        Minibatch size when ``fit`` gets tensors.
    prior_mean : float or torch.Tensor, default=0.0
        Prior mean ``μ₀`` (scalar or ``(P,)``); enters the evidence only.
    prior_structure : {'scalar', 'layerwise', 'diag'}, optional
        Which prior precisions may be set after ``fit`` without a new pass over
        the data (default: that of ``prior_precision``); see
        :mod:`._hyperparameters`. ``'layerwise'`` keeps ``n_layers²`` blocks of
        ``(MC)²``.
    compute_dtype : torch.dtype, None or 'auto', default='auto'
        The dtype of the Jacobians and of every sum: a model in another floating
        dtype (float32) is copied in this one (at ``fit`` its current parameters
        are copied in) when the backend is built here (a class), and predictions
        are returned in the model's dtype. ``None`` computes in the model's dtype
        (no copy; the copy costs the model's memory in float64). ``'auto'``:
        float64 on a CPU and on GPUs whose float64 runs near float32's rate
        (compute capabilities 8.0, 9.0, 10.0: A100, H100, H200, B200), the
        model's dtype on other devices, where float64 takes 30–60× the time
        (:func:`laplace_diffjac._device_arithmetic.default_compute_dtype`).
    predictive_mean : {'network', 'dual'}, default='network'
        ``'network'``: the MAP network's output, laplace-torch's GLM mean.
        ``'dual'``: the posterior mean of the linearised network's GP through the
        locations (:mod:`._dual_mean`; needs targets at ``fit``), which equals the
        network on the data of the fit when ``Z = X`` and moves with ``update``.
    structured : bool, default=True
        With a backend that hands out per-layer factors (``DiffBackPackGGN``,
        ``DiffBackPackEF`` over all parameters), compute every Gram, the GGN
        diagonal and the dual mean from them: no Jacobian ``J`` of the locations
        or of a batch is formed (:mod:`._features`). ``False`` forms the
        Jacobians (the reference route); other backends always do. Either way,
        where every parameter is a plain ``nn.Linear``'s and the prior is one
        scalar, predictions take their Grams from the layers' inputs and
        signals (:mod:`._linear_predictions`; not for
        ``predictive_mean='dual'``, whose mean needs ``J δ``): the same numbers;
        a BoTorch posterior call with its gradient at 0.75–0.93× the time.

    Raises
    ------
    ValueError
        For an unknown likelihood, ``sigma_noise != 1`` with classification, an
        invalid prior precision or structure, or a ``compute_dtype`` string other
        than ``'auto'``.
    InvalidInputError
        For locations that are not finite, not in the model's dtype, not batched,
        or of a feature shape the model does not accept (one forward pass on one
        location, the model's state restored).

    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        locations: torch.Tensor,
        sigma_noise: float | torch.Tensor = 1.0,
        prior_precision: PriorPrecision = 1.0,
        temperature: float = 1.0,
        backend: BackendSpec = DiffBackPackGGN,
        enable_backprop: bool = False,
        jitter: float = 1e-8,
        batch_size: int = 256,
        prior_mean: float | torch.Tensor = 0.0,
        prior_structure: str | None = None,
        compute_dtype: torch.dtype | str | None = "auto",
        predictive_mean: str = "network",
        structured: bool = True,
    ) -> None:
        if likelihood not in ("regression", "classification"):
            raise ValueError(
                "likelihood must be 'regression' or 'classification', got "
                f"{likelihood!r}."
            )
        param = next(iter(model.parameters()))
        if isinstance(compute_dtype, str):
            if compute_dtype != "auto":
                raise ValueError(
                    "compute_dtype must be a torch.dtype, None (the model's dtype) "
                    f"or 'auto' (float64 where the device runs it fast), got "
                    f"{compute_dtype!r}."
                )
            compute_dtype = default_compute_dtype(param.device)
        check_inputs(locations, "locations", param.dtype, None)
        check_fits_model(locations, "locations", model)
        self.model = model
        self.likelihood = likelihood
        self.locations = locations.detach()
        self._compute_model = compute_copy(model, backend, compute_dtype)
        self.backend = as_backend(model, likelihood, backend)
        self._compute_backend = (
            self.backend
            if self._compute_model is model
            else as_backend(self._compute_model, likelihood, backend)
        )
        self._dtype, self._device = param.dtype, param.device
        self._compute_dtype = next(iter(self._compute_model.parameters())).dtype
        self._layer_sizes = layer_sizes(self.backend)
        self.prior_precision = prior_precision
        self.sigma_noise = sigma_noise
        self.temperature = temperature
        self.prior_mean = prior_mean
        infer_structure(prior_structure, self.prior_precision, self.n_layers)
        self._structure_request = prior_structure
        self.predictive_mean = check_predictive_mean(predictive_mean)
        self.enable_backprop = enable_backprop
        self.jitter = jitter
        self.batch_size = batch_size
        self.structured = bool(structured)
        self._acc: Accumulators | None = None
        self._groups: PriorGroups | None = None
        self._factors = FactorCache()
        self._sizes: FeatureSizes | None = None
        self._chunks: Chunks | None = None
        #: The Linear layers' route of predictions, where it applies to the fit.
        self._linear: LinearPredictions | None = None

    def fit(self, train_loader: Data, progress_bar: bool = False) -> ContextPosterior:
        """Accumulate the data's sums (``K_ZX Λ K_XZ``, GGN diagonal, loss).

        Parameters
        ----------
        train_loader : DataLoader, torch.Tensor or tuple
            Training data: a loader of ``(x, y)`` batches (also over an
            ``IterableDataset``; one batch is held at a time), inputs or
            ``(x, y)``. The posterior needs no targets; the evidence does.
            Under ``torch.distributed``: this rank's shard (may be empty); the
            sums are all-reduced, so every rank gets the same posterior. Every
            rank must call ``fit``.
        progress_bar : bool, default=False
            Show a tqdm progress bar.

        Returns
        -------
        ContextPosterior
            ``self``.

        Raises
        ------
        InvalidInputError
            For training inputs that are not finite, have another feature shape
            than the locations or another dtype than the model (before any work
            for tensors; for a loader the posterior is left as it was), for a
            ``DistributedSampler`` that pads its shards with repeated points,
            for targets whose shape or dtype does not fit the likelihood and the
            model's outputs (:func:`~laplace_diffjac.data.check_targets`), or if
            there are no training points at all.

        """
        data = TrainingData(train_loader, self.batch_size, "train_loader")
        data.check(self._dtype, self.locations.shape[1:])
        prec = self.prior_precision.detach()
        structure = infer_structure(self._structure_request, prec, self.n_layers)
        groups = PriorGroups.build(structure, prec, self._layer_sizes)
        sync_copy(self._compute_model, self.model)
        loader = data.loader
        largest = self.batch_size if loader is None else loader.batch_size or 1024
        chunks = self._plan(largest, len(groups.bounds), None)
        acc = Accumulators.empty(self._location_features(chunks), groups, self.jitter)
        shape = self.locations.shape[1:]
        accumulate(
            self._compute_backend,
            self.likelihood,
            acc,
            groups,
            data,
            shape,
            self._dtype,
            progress_bar,
            self._offset(),
            self.structured,
            chunks.data,
        )
        reduce_accumulators(acc)
        if acc.n_data == 0:
            raise InvalidInputError(
                "train_loader yielded no training points (on any rank); pass the "
                "training data."
            )
        self._acc, self._groups, self._chunks = acc, groups, chunks
        self._linear = self._linear_route(groups, chunks.whole)
        self._factors.clear()
        return self

    def update(
        self, x_new: torch.Tensor, y_new: torch.Tensor | None = None
    ) -> ContextPosterior:
        """Fold new data into the posterior without touching the old data.

        Costs ``O(b (MC)²)`` per group pair plus the new Jacobians; the result
        equals ``fit`` on the union of the data (the sums are additive).

        Parameters
        ----------
        x_new : torch.Tensor
            ``(b, *input_shape)``; under ``torch.distributed`` this rank's new
            points (``b = 0`` allowed), reduced over the ranks like ``fit``'s;
            every rank must call ``update``.
        y_new : torch.Tensor, optional
            ``(b, ...)`` targets; without them the evidence is unavailable.

        Returns
        -------
        ContextPosterior
            ``self``.

        Raises
        ------
        RuntimeError
            Before ``fit``.
        InvalidInputError
            As for :meth:`fit`.

        """
        acc, groups = self._fitted()
        shape = self.locations.shape[1:]
        check_inputs(x_new, "x_new", self._dtype, shape, allow_empty=is_distributed())
        data = TrainingData((x_new, y_new), self.batch_size, "x_new")
        new = acc.zeros_like()
        accumulate(
            self._compute_backend,
            self.likelihood,
            new,
            groups,
            data,
            shape,
            self._dtype,
            False,
            self._offset(),
            self.structured,
            self._data_chunk(len(x_new)),
        )
        reduce_accumulators(new)  # only the new sums: the old ones are reduced
        acc.merge(new)
        self._factors.clear()
        return self

    @property
    def n_params(self) -> int:
        """Number ``P`` of parameters (Jacobian columns)."""
        return sum(self._layer_sizes)

    @property
    def n_layers(self) -> int:
        """Number of parameter tensors (the length of a layerwise prior)."""
        return len(self._layer_sizes)

    @property
    def n_outputs(self) -> int:
        """Number ``C`` of outputs (after ``fit``)."""
        return self._fitted()[0].n_outputs

    @property
    def n_data(self) -> int:
        """Number ``N`` of training points accumulated (0 before ``fit``)."""
        return 0 if self._acc is None else self._acc.n_data

    @property
    def fitted_prior_structure(self) -> str | None:
        """The prior structure ``fit`` kept sums for, or ``None`` before ``fit``."""
        return None if self._groups is None else self._groups.structure

    @property
    def prior_precision(self) -> torch.Tensor:
        """Prior precision ``(1,)``, ``(n_layers,)`` or ``(P,)``; settable."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: float | torch.Tensor) -> None:
        self._prior_precision = check_prior_precision(
            value, self.n_layers, self.n_params, self._dtype, self._device
        )

    @property
    def sigma_noise(self) -> torch.Tensor:
        """Observation noise ``()``; settable (regression)."""
        return self._sigma_noise

    @sigma_noise.setter
    def sigma_noise(self, value: float | torch.Tensor) -> None:
        self._sigma_noise = check_sigma_noise(
            value, self.likelihood, self._dtype, self._device
        )

    @property
    def prior_mean(self) -> torch.Tensor:
        """Prior mean ``()`` or ``(P,)``."""
        return self._prior_mean

    @prior_mean.setter
    def prior_mean(self, value: float | torch.Tensor) -> None:
        mean = torch.as_tensor(value, dtype=self._dtype, device=self._device)
        if mean.numel() not in (1, self.n_params) or mean.ndim > 1:
            raise ValueError(
                f"prior_mean must be a scalar or have {self.n_params} entries."
            )
        self._prior_mean = mean.reshape(()) if mean.numel() == 1 else mean

    @property
    def prior_precision_diag(self) -> torch.Tensor:
        """Per-parameter prior precision ``(P,)``."""
        return expand_precision(self.prior_precision, self._layer_sizes)

    @property
    def mean(self) -> torch.Tensor:
        """MAP parameters ``θ*`` ``(P,)``, the Jacobian columns' parameters."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.backend.params])
        indices = getattr(self.backend, "subnetwork_indices", None)
        if indices is not None:
            return flat[indices]
        return flat[flat.numel() - self.n_params :]

    @property
    def loss(self) -> torch.Tensor:
        """Training loss at the MAP, as laplace-torch's ``loss`` (after ``fit``)."""
        return self._fitted()[0].loss

    def _fitted(self) -> tuple[Accumulators, PriorGroups]:
        if self._acc is None or self._groups is None:
            raise RuntimeError("Call fit before predicting or computing the evidence.")
        return self._acc, self._groups

    def _scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group variances ``(G,)``, per-parameter ``Σ₀`` ``(P,)``, ``h = 1/(σ² T)``."""
        _, groups = self._fitted()
        s, h = self._group_scales()
        bounds = groups.bounds
        sizes = torch.tensor([b - a for a, b in bounds], device=s.device)
        prior_var = torch.repeat_interleave(s, sizes) * groups.weight.to(s)
        return s, prior_var, h

    def _group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Group variances ``(G,)`` and ``h = 1/(σ² T)`` (no per-parameter ``Σ₀``)."""
        _, groups = self._fitted()
        s = groups.group_variances(self.prior_precision, self._layer_sizes)
        sigma2 = self.sigma_noise.to(torch.float64).square()
        h = (
            1.0 / (sigma2 * self.temperature)
            if self.likelihood == "regression"
            else (
                torch.ones((), dtype=torch.float64, device=s.device) / self.temperature
            )
        )
        return s, h

    @property
    def log_likelihood(self) -> torch.Tensor:
        """``log p(y | θ*)`` on the training data, as laplace-torch's."""
        acc, _ = self._fitted()
        n_out = acc.n_outputs
        return log_likelihood(
            acc, self.likelihood, self.sigma_noise, self.temperature, n_out
        )

    @property
    def scatter(self) -> torch.Tensor:
        """``(θ* − μ₀)ᵀ P₀ (θ* − μ₀)``, as laplace-torch's."""
        delta = (self.mean - self.prior_mean).to(torch.float64)
        return (delta * self.prior_precision_diag.to(torch.float64)) @ delta

    @property
    def log_det_ratio(self) -> torch.Tensor:
        """Upper bound on ``log det P − log det P₀`` through the locations.

        ``log det(I + L⁻¹ K_ZX Λ K_XZ L⁻ᵀ) + Σₙ tr(Λₙ (kₙₙ − Qₙₙ))``; equal to
        laplace-torch's ``log_det_ratio`` when ``Z = X`` (``K_XX`` invertible).
        """
        acc, _ = self._fitted()
        s, prior_var, h = self._scales()
        spectrum = self._factors.evidence_spectrum(acc, s, h, self.jitter)
        log_det, trace = evidence_terms(acc, s, prior_var, h, self.jitter, spectrum)
        return log_det + trace

    def log_marginal_likelihood(
        self,
        prior_precision: torch.Tensor | None = None,
        sigma_noise: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Lower bound on the GGN Laplace log evidence, exact when ``Z = X``.

        ``log p(y | θ*) − ½ (scatter + log_det_ratio)`` (see
        :mod:`~laplace_diffjac.context.posterior._evidence` for the derivation). As in
        laplace-torch, given values overwrite the current ones; the result is
        differentiable in them (scalar or layerwise prior precision, ``σ``).

        Parameters
        ----------
        prior_precision : torch.Tensor, optional
            ``(1,)``, ``(n_layers,)`` (needs ``prior_structure='layerwise'`` at
            fit) or ``(P,)`` (only the value at fit, not differentiable).
        sigma_noise : torch.Tensor, optional
            Observation noise (regression only).

        Returns
        -------
        torch.Tensor
            ``()`` float64.

        Raises
        ------
        ValueError
            For ``sigma_noise`` with classification, a prior precision the fitted
            sums cannot represent, or a fit without targets.
        RuntimeError
            Before ``fit``.

        """
        if prior_precision is not None:
            self.prior_precision = prior_precision
        if sigma_noise is not None:
            if self.likelihood != "regression":
                raise ValueError("Can only change sigma_noise for regression.")
            self.sigma_noise = sigma_noise
        return self.log_likelihood - 0.5 * (self.log_det_ratio + self.scatter)

    def optimize_prior_precision(
        self,
        pred_type: str = "glm",
        method: str = "marglik",
        n_steps: int = 100,
        lr: float = 1e-1,
        init_prior_prec: float | torch.Tensor = 1.0,
        prior_structure: str = "scalar",
        val_loader: DataLoader | None = None,
        loss: Any = None,
        log_prior_prec_min: float = -4,
        log_prior_prec_max: float = 4,
        grid_size: int = 100,
        link_approx: str = "probit",
        n_samples: int = 100,
        verbose: bool = False,
        progress_bar: bool = False,
        log_prior_prec_base: float = 10.0,
        learn_sigma_noise: bool = False,
    ) -> None:
        """Choose the prior precision as laplace-torch's method of that name.

        ``'marglik'``: Adam on the log prior precision (and, with
        ``learn_sigma_noise=True``, log ``σ``, which laplace-torch only tunes in
        ``marglik_training``) against :meth:`log_marginal_likelihood`, starting
        from ``init_prior_prec`` with ``prior_structure`` ``'scalar'`` or
        ``'layerwise'``. ``'gridsearch'``: the value on
        ``log_prior_prec_base ** linspace(min, max, grid_size)`` with the smallest
        validation ``loss`` (default: MSE for regression, NLL for classification)
        of ``la(x, pred_type, link_approx, n_samples)``. Other arguments as in
        laplace-torch.

        Raises
        ------
        ValueError
            For an unknown method or pred_type, a grid search without
            ``val_loader``, a per-parameter marglik prior, or a layerwise one the
            fit kept no sums for.

        """
        if pred_type not in ("glm", "gp"):
            raise ValueError(f"pred_type must be 'glm' or 'gp', got {pred_type!r}.")
        if method == "marglik" and val_loader is not None:
            warnings.warn(
                "`val_loader` will be ignored when `method` == 'marglik'. "
                "Do you mean to set `method = 'gridsearch'`?",
                stacklevel=2,
            )
        if method == "marglik":
            _tuning.marglik(self, init_prior_prec, str(prior_structure), n_steps, lr,
                            learn_sigma_noise, progress_bar)  # fmt: skip
        elif method == "gridsearch":
            base, size = log_prior_prec_base, grid_size
            lo, hi = log_prior_prec_min, log_prior_prec_max
            grid = torch.logspace(lo, hi, size, base=base, dtype=torch.float64)
            _tuning.gridsearch(self, val_loader, loss, grid, pred_type, link_approx,
                               n_samples, progress_bar)  # fmt: skip
        else:
            raise ValueError(
                f"method must be 'marglik' or 'gridsearch', got {method!r}."
            )
        if verbose:
            print(f"Optimized prior precision is {self.prior_precision}.")

    def state_dict(self) -> dict[str, Any]:
        """Everything the posterior needs, tensors and plain values only.

        Returns
        -------
        dict
            Loadable with ``torch.load(weights_only=True)``.

        Raises
        ------
        RuntimeError
            Before ``fit``.

        """
        return posterior_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the model must be the saved one's.

        Parameters
        ----------
        state_dict : dict
            From :meth:`state_dict`.

        Raises
        ------
        ValueError
            If it is not a ContextPosterior state, or the parameter count, the
            parameter shapes or the likelihood differ.

        """
        load_posterior_state(self, state_dict)

    def _compute_locations(self) -> torch.Tensor:
        return self.locations.to(device=self._device, dtype=self._compute_dtype)

    def _plan(self, batch: int, n_groups: int, hold: bool | None) -> Chunks:
        """Chunks for passes over batches of up to ``batch`` inputs (the budget's)."""
        Z = self._compute_locations()
        if self._sizes is None:
            self._sizes = feature_sizes(self._compute_backend, Z, self.structured)
        budget = get_memory_budget(self._device)
        return plan_chunks(self._sizes, len(Z), batch, n_groups, budget, hold)

    def _data_chunk(self, batch: int) -> int:
        """Inputs per chunk for a pass over ``batch`` inputs after ``fit``."""
        acc, groups = self._fitted()
        hold = not isinstance(acc.locations, ChunkedFeatures) or acc.locations.held
        return self._plan(batch, len(groups.bounds), hold).data

    def _location_features(self, chunks: Chunks | None = None) -> BatchFeatures:
        """The locations' features (factors or ``J_Z``), detached, float64.

        Held whole unless ``chunks`` says otherwise: then in blocks, held or
        computed again whenever they are used (:class:`._chunks.ChunkedFeatures`).

        Returns
        -------
        BatchFeatures
        """
        Z = self._compute_locations()
        backend, structured = self._compute_backend, self.structured
        if chunks is None or chunks.whole:
            return location_features(backend, Z, structured)

        def block(where: slice) -> BatchFeatures:
            return location_features(backend, Z[where], structured)

        return ChunkedFeatures(block, len(Z), chunks.locations, chunks.hold_locations)

    def _linear_route(
        self, groups: PriorGroups, whole: bool
    ) -> LinearPredictions | None:
        """The Linear layers' route for the fit (or loaded state) just made, if any."""
        scalar = groups.structure == "scalar" and whole
        Z = self._compute_locations()
        return LinearPredictions.of(self._compute_backend, Z, scalar)

    def _offset(self) -> torch.Tensor:
        """``θ* − μ₀`` ``(P,)`` in float64 (the dual mean's linearisation)."""
        mean = self.mean.to(torch.float64)
        return mean - self.prior_mean.to(mean).expand_as(mean)
