"""What laplace-torch users call on a Laplace object, for the context posterior.

Hyperparameters (validated as laplace-torch's setters do), the evidence and its
terms (``log_likelihood``, ``scatter``, ``log_det_ratio``,
``log_marginal_likelihood``), ``optimize_prior_precision`` and saving
(``state_dict`` / ``load_state_dict``). The maths lives in
:mod:`~laplace_diffjac.context._evidence`; the data sums in
:mod:`~laplace_diffjac.context._state`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from ..backends import JacobianBackend
from ..kernels import n_jacobian_columns
from . import _tuning
from ._evidence import evidence_terms, log_likelihood
from ._factor_cache import FactorCache
from ._hyperparameters import (
    PriorGroups,
    check_prior_precision,
    check_sigma_noise,
    expand_precision,
)
from ._state import Accumulators

__all__ = ["LaplaceInterface", "layer_sizes"]

_FORMAT = "laplace_diffjac.ContextPosterior/1"


def layer_sizes(backend: JacobianBackend) -> list[int]:
    """Parameters per parameter tensor, or ``[P]`` when the columns are a subset."""
    P = n_jacobian_columns(backend)
    sizes = [p.numel() for p in backend.params]
    return sizes if sum(sizes) == P else [P]


class LaplaceInterface:
    """Mixin: hyperparameters, evidence, tuning and saving (see module docstring)."""

    likelihood: str
    model: torch.nn.Module
    backend: JacobianBackend
    temperature: float
    jitter: float
    enable_backprop: bool
    locations: torch.Tensor
    _dtype: torch.dtype
    _device: torch.device
    _layer_sizes: list[int]
    _acc: Accumulators | None
    _groups: PriorGroups | None
    _factors: FactorCache
    _structure_request: str | None

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
        return int(self._fitted()[0].J_z.shape[1])

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
        s = groups.group_variances(self.prior_precision, self._layer_sizes)
        bounds = groups.bounds
        sizes = torch.tensor([b - a for a, b in bounds], device=s.device)
        prior_var = torch.repeat_interleave(s, sizes) * groups.weight.to(s)
        sigma2 = self.sigma_noise.to(torch.float64).square()
        h = (
            1.0 / (sigma2 * self.temperature)
            if self.likelihood == "regression"
            else (
                torch.ones((), dtype=torch.float64, device=s.device) / self.temperature
            )
        )
        return s, prior_var, h

    @property
    def log_likelihood(self) -> torch.Tensor:
        """``log p(y | θ*)`` on the training data, as laplace-torch's."""
        acc, _ = self._fitted()
        n_out = int(acc.J_z.shape[1])
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
        :mod:`~laplace_diffjac.context._evidence` for the derivation). As in
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
        if method == "marglik":
            if val_loader is not None:
                import warnings

                warnings.warn(
                    "`val_loader` will be ignored when `method` == 'marglik'. "
                    "Do you mean to set `method = 'gridsearch'`?",
                    stacklevel=2,
                )
            _tuning.marglik(
                self,
                init_prior_prec,
                str(prior_structure),
                n_steps,
                lr,
                learn_sigma_noise,
                progress_bar,
            )
        elif method == "gridsearch":
            grid = torch.logspace(
                log_prior_prec_min,
                log_prior_prec_max,
                grid_size,
                base=log_prior_prec_base,
                dtype=torch.float64,
            )
            _tuning.gridsearch(
                self,
                val_loader,
                loss,
                grid,
                pred_type,
                link_approx,
                n_samples,
                progress_bar,
            )
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
        acc, groups = self._fitted()
        return {
            "format": _FORMAT,
            "mean": self.mean,
            "param_shapes": [list(p.shape) for p in self.backend.params],
            "likelihood": self.likelihood,
            "locations": self.locations,
            "prior_precision": self.prior_precision.detach(),
            "prior_mean": self.prior_mean.detach(),
            "sigma_noise": self.sigma_noise.detach(),
            "temperature": float(self.temperature),
            "enable_backprop": bool(self.enable_backprop),
            "jitter": float(self.jitter),
            "prior_structure": groups.structure,
            "group_bounds": [list(b) for b in groups.bounds],
            "group_weight": groups.weight,
            "accumulators": acc.to_state(),
        }

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
        if state_dict.get("format") != _FORMAT:
            raise ValueError(
                "Loading a wrong Laplace type: not a ContextPosterior state."
            )
        if len(state_dict["mean"]) != self.n_params or state_dict["param_shapes"] != [
            list(p.shape) for p in self.backend.params
        ]:
            raise ValueError(
                "Attempting to load a ContextPosterior fitted on a model with "
                "different parameters (count or shapes) than this one's."
            )
        if self.likelihood != state_dict["likelihood"]:
            raise ValueError(
                f"Different likelihoods: saved {state_dict['likelihood']!r}, this "
                f"posterior {self.likelihood!r}."
            )
        self.locations = state_dict["locations"].to(self._device)
        self.prior_precision = state_dict["prior_precision"]
        self.prior_mean = state_dict["prior_mean"]
        self.sigma_noise = state_dict["sigma_noise"]
        self.temperature = state_dict["temperature"]
        self.enable_backprop = state_dict["enable_backprop"]
        self.jitter = state_dict["jitter"]
        bounds = tuple(tuple(b) for b in state_dict["group_bounds"])
        self._groups = PriorGroups(
            state_dict["prior_structure"],
            bounds,
            state_dict["group_weight"],
            self.n_layers,
        )
        self._acc = Accumulators.from_state(state_dict["accumulators"])
        self._factors.clear()
