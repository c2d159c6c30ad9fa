"""laplace-torch's ``FunctionalLaplace`` with given context locations.

``FunctionalLaplace.fit`` draws ``n_subset`` training points at random
(``_get_SoD_data_loader``) and uses them for everything: the kernel ``K_MM``, the
likelihood Hessians ``Λ_MM`` (from the MAP outputs there, not the targets) and,
only for the marginal likelihood, the targets ``y``. The linearised predictive
needs no targets: its mean is the MAP network and its covariance
``K** − K*M (K_MM + Λ_MM⁻¹)⁻¹ K_M*`` depends on the inputs only.

:class:`LocationFunctionalLaplace` overrides that one hook: the subset loader yields
the given locations with pseudo-targets, the MAP predictions ``f(Z)`` (regression)
or their arg-max classes (classification). ``fit`` still receives the real training
loader, so ``n_data = N`` and laplace-torch's subset-of-data prior scaling
``M / N`` is the same as for a random subset: with the locations set to the subset
``FunctionalLaplace`` would draw, the two posteriors are identical (tested).

The marginal likelihood (``log_marginal_likelihood``, prior optimisation by
``'marglik'``) then refers to the pseudo-targets and is not the data's.

Two departures from laplace-torch, both confined to this class:

* the test-to-subset kernel is assembled with the output axes in the right order
  (:meth:`LocationFunctionalLaplace._build_K_star_M`; laplace-torch 0.2.3 and 0.3
  pair the subset index with the *test* output for ``C > 1``);
* ``output_hessian='full'`` keeps the whole ``C × C`` GGN likelihood Hessian
  ``Λ_m`` of every location. laplace-torch keeps only its diagonal, which for a
  softmax likelihood adds curvature along ``f_1 + … + f_C`` that the likelihood
  does not have (``Λ_m 1 = 0``): on two moons that alone puts the latent variances
  a factor ``e^1.5``–``e^1.9`` away from the full-data GGN Laplace, even with all
  ``N`` points as the subset. For regression (``Λ = I / σ²``) both are the same.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from laplace import FunctionalLaplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..backends import DiffBackPackGGN, upstream_stand_in
from ..budget import get_memory_budget
from ..data import Data, SizedLoader, TrainingData
from ..jacobians._engine import JacobianFactors
from ..jacobians._factor_products import factor_jvp
from ..kernels import factor_route_applies, ntk, ntk_diag, output_hessians
from ..kernels._engine_pieces import engine_factors
from ..kernels._factor_gram import factor_gram
from ..kernels._feature_sizes import feature_sizes
from ._compat import LAPLACE_VERSION

__all__ = [
    "CHECKED_RELEASES",
    "PRIVATE_OVERRIDES",
    "LocationFunctionalLaplace",
    "functional_laplace_on_locations",
]

#: laplace-torch releases whose private ``FunctionalLaplace`` code the overrides
#: below were read against and are tested with.
CHECKED_RELEASES: tuple[tuple[int, ...], ...] = ((0, 2, 3), (0, 3))

#: laplace-torch's private methods this class overrides, and what each relies on.
PRIVATE_OVERRIDES: dict[str, str] = {
    "_get_SoD_data_loader": "called once by fit to draw the subset-of-data loader",
    "_build_K_star_M": "builds K*M (K_MM + Λ_MM⁻¹)⁻¹ K_M* from (N*, b, C, C) blocks",
    "_build_Sigma_inv": "factorises K_MM + Λ_MM⁻¹ from K_MM, L and _H_factor",
    "_glm_predictive_distribution": (
        "called by __call__ with (X, joint): (f_mu, f_var) from the Jacobians of X"
    ),
}


def _check_release() -> None:
    """Refuse a laplace-torch release the private overrides were not checked on."""
    missing = [
        name for name in PRIVATE_OVERRIDES if not hasattr(FunctionalLaplace, name)
    ]
    if LAPLACE_VERSION in CHECKED_RELEASES and not missing:
        return
    checked = ", ".join(".".join(map(str, r)) for r in CHECKED_RELEASES)
    found = ".".join(map(str, LAPLACE_VERSION))
    raise RuntimeError(
        f"LocationFunctionalLaplace overrides laplace-torch's private "
        f"FunctionalLaplace methods {sorted(PRIVATE_OVERRIDES)}, checked against "
        f"laplace-torch {checked}; the installed release is {found}"
        + (f" (it lacks {missing})" if missing else "")
        + ". Install a checked release (pip install 'laplace-torch==0.3'), or use "
        "laplace_diffjac.ContextPosterior, which does not depend on laplace-torch's "
        "internals."
    )


class LocationFunctionalLaplace(FunctionalLaplace):
    """``FunctionalLaplace`` whose subset-of-data points are given locations.

    Parameters
    ----------
    model : torch.nn.Module
        Trained network.
    likelihood : {'regression', 'classification'}
        The likelihood.
    locations : torch.Tensor
        Context locations ``(M, *input_shape)``; ``n_subset = M``.
    backend : type, default=DiffBackPackGGN
        Curvature backend class (any class with laplace-torch's ``jacobians``;
        laplace-torch's own check only admits its three built-in classes).
    reweight : bool, default=False
        ``False``: laplace-torch's subset-of-data scaling (kernel times ``M / N``),
        as for a random subset. ``True``: each location stands for ``N / M``
        training points, i.e. the kernel is not scaled and the likelihood
        Hessians at the locations are multiplied by ``N / M``; in the weight-space
        view the posterior precision is ``δ I + (N / M) Σ_m J_mᵀ Λ_m J_m``, which
        approximates the full-data ``δ I + Σ_n J_nᵀ Λ_n J_n`` when the locations
        represent the data.
    output_hessian : {'diagonal', 'full'}, default='diagonal'
        ``'diagonal'``: laplace-torch's diagonal of ``Λ_m`` (its behaviour).
        ``'full'``: the whole ``C × C`` block, i.e. the GGN's likelihood Hessian;
        the predictive covariance is then
        ``K** − K*M R (I + R K_MM R)⁻¹ R K_M*`` with ``R = Λ_MM^{1/2}`` (no inverse
        of the singular softmax Hessian). Not with ``independent_outputs=True``;
        the marginal likelihood still uses laplace-torch's diagonal factor.
    structured : bool, default=True
        Fit and predict (``la(x)``) from the backend's per-layer factors (the
        factor route of :func:`laplace_diffjac.kernels.ntk`): ``K_MM``,
        ``k(x*, x*)`` and ``k(x*, Z)`` without the locations' or the test
        inputs' Jacobians ``(M, C, P)``, ``(N*, C, P)``. It applies to the
        backends with ``jacobian_factors`` (``DiffBackPackGGN``,
        ``DiffBackPackEF``) and dependent outputs; otherwise, and with
        ``False``, laplace-torch's route through the Jacobians. The public
        ``functional_variance(Js)`` and ``functional_covariance(Js)`` take
        Jacobians and are laplace-torch's either way.
    **kwargs
        Passed to ``FunctionalLaplace`` (``sigma_noise``, ``prior_precision``,
        ``temperature``, ``enable_backprop``, ``independent_outputs``, ...).

    """

    # laplace-torch's ``Laplace`` factory maps ``_key`` to the class of every
    # ``BaseLaplace`` subclass; inheriting ``("all", "gp")`` would let this class
    # shadow ``FunctionalLaplace`` there.
    _key = None

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        locations: torch.Tensor,
        backend: type = DiffBackPackGGN,
        reweight: bool = False,
        output_hessian: str = "diagonal",
        structured: bool = True,
        **kwargs: Any,
    ) -> None:
        _check_release()
        kwargs.pop("n_subset", None)
        if output_hessian not in ("diagonal", "full"):
            raise ValueError(
                f"output_hessian must be 'diagonal' or 'full', got {output_hessian!r}."
            )
        if output_hessian == "full" and kwargs.get("independent_outputs", False):
            raise ValueError("output_hessian='full' needs independent_outputs=False.")
        super().__init__(
            model,
            likelihood,
            n_subset=locations.shape[0],
            backend=upstream_stand_in(backend),
            **kwargs,
        )
        self._backend_cls = backend  # the backend is built lazily, on first use
        self._backend = None
        self.locations = locations.detach()
        self.reweight = reweight
        self.output_hessian = output_hessian
        self.structured = structured
        self._lam_full: torch.Tensor | None = None  # (M, C, C), without 1/(σ² T)
        self._full_R: torch.Tensor | None = None
        self._full_chol: torch.Tensor | None = None
        self._location_factors: JacobianFactors | None = None  # set per fit

    def fit(
        self,
        train_loader: Data,
        progress_bar: bool = False,
        n_data: int | None = None,
    ) -> None:
        """Fit on the locations; ``train_loader`` sets ``N`` (and the batch size).

        Only the first batch is read (for the output size), so a loader over an
        ``IterableDataset`` streams; laplace-torch takes ``N`` from
        ``len(train_loader.dataset)``, which such a data set may not have: then
        pass ``n_data``.

        Parameters
        ----------
        train_loader : DataLoader, torch.Tensor or tuple
            The training data, read as :class:`ContextPosterior` reads it (a
            loader, inputs or ``(x, y)``); not used beyond its size ``N`` and the
            model's output size.
        progress_bar : bool, default=False
            Show laplace-torch's progress bar (its Jacobian route; the factor
            route is one pass over the locations).
        n_data : int, optional
            The number ``N`` of training points, instead of
            ``len(train_loader.dataset)``. Under ``torch.distributed`` with a
            split of your own, pass the global ``N`` (a ``DistributedSampler``
            loader's data set already has it); the fit itself reads only the
            locations and is the same on every rank.

        Raises
        ------
        InvalidInputError
            If ``N`` is unknown (a data set without ``len`` and no ``n_data``),
            or ``n_data`` is not a positive integer.

        """
        data = TrainingData(train_loader, name="train_loader")
        loader = data.as_loader()
        sized = cast(DataLoader, SizedLoader(loader, data.size(n_data)))
        if self.output_hessian == "full":
            with torch.no_grad():
                f = self.model(self.locations.to(self._device))
            self._lam_full = output_hessians(f.to(torch.float64), self.likelihood)
        self._location_factors = None
        if self._factor_route_applies():
            self._fit_from_factors(sized)
        else:
            super().fit(sized, progress_bar=progress_bar)
        self._recompute_Sigma = False  # 0.2.3 leaves it set after fitting
        self._sigma_key = self._hyper_key()
        if self.reweight:
            weight = self.n_data / self.n_subset
            self._prior_factor_sod = 1.0
            hessians: Any = vars(self)["L"]  # laplace-torch's Λ_MM (list or tensor)
            if isinstance(hessians, list):
                self.L = [lam * weight for lam in hessians]
            else:
                self.L = hessians * weight
            self._build_Sigma_inv()
            self._recompute_Sigma = False

    def _factor_route_applies(self) -> bool:
        """Whether ``fit`` and ``la(x)`` can work from per-layer factors."""
        return (
            self.structured
            and not self.independent_outputs
            and factor_route_applies(self.backend)
        )

    def _fit_from_factors(self, train_loader: DataLoader) -> None:
        """laplace-torch's ``FunctionalLaplace.fit`` without the locations' Jacobians.

        The same state as laplace-torch's loop (``K_MM``, ``L``, ``mu``, ``loss``,
        the subset loader and sizes, ``Sigma_inv``), from one pass over the
        locations: ``K_MM`` is the Gram of their per-layer factors
        (:func:`~laplace_diffjac.kernels.ntk`'s factor route) and the scatter
        term's ``J (μ₀ − θ*)`` their Jacobian-vector product from the same
        factors, so neither the
        ``(M, C, P)`` Jacobians nor laplace-torch's second pass per pair of
        batches is formed. laplace-torch reads the output size from the first
        training batch; the locations' outputs give it here (the same for a
        network with one output layer).

        Parameters
        ----------
        train_loader : DataLoader
            The training loader with its size (``len(.dataset) = N``).

        Raises
        ------
        ValueError
            If there are more locations than training points (laplace-torch's
            ``n_subset <= N``).

        """
        self.model.eval()
        N = len(train_loader.dataset)  # type: ignore[arg-type]
        if self.n_subset > N:
            raise ValueError(
                f"There are {self.n_subset} locations but {N} training points; "
                "use at most as many locations as training points."
            )
        self.n_data = N
        self.batch_size = train_loader.batch_size
        self.train_loader = self._get_SoD_data_loader(train_loader)
        self._prior_factor_sod = self.n_subset / self.n_data
        backend = self.backend
        Z = self.locations.to(self._device)
        params = list(backend.params)
        offset = self.prior_mean - self.mean
        whole = self._fits_whole(Z, 0, False)
        with torch.no_grad():
            parts = _location_parts(backend, Z, params, offset, whole)
        f, shift, factors = parts
        self._location_factors = factors
        self.n_outputs = f.shape[-1]
        self.model.output_size = self.n_outputs  # as laplace-torch's fit
        y = f.argmax(dim=-1) if self.likelihood == "classification" else f
        with torch.no_grad():
            self.loss += backend.factor * backend.lossfunc(f, y)
        M, C = f.shape
        lambdas = output_hessians(f, self.likelihood).to(self._dtype)
        # laplace-torch's scatter mean: y − (f + J (μ₀ − θ*)) for regression,
        # −J (μ₀ − θ*) for classification; the pseudo-targets are y = f.
        self.mu = -shift
        unit = torch.ones((), dtype=f.dtype, device=f.device)
        if factors is not None:
            gram = factor_gram(factors, factors, params, unit).detach()
        else:  # the locations' Gram in the budget's chunks ([m, n, c, e])
            with torch.no_grad():
                gram = ntk(backend, Z)
        self.K_MM = gram.permute(0, 2, 1, 3).reshape(M * C, M * C).to(self._dtype)
        self.L = self._build_L([lambdas])
        self._build_Sigma_inv()
        self._fitted = True

    def _hyper_key(self) -> tuple:
        """The hyperparameters the factor depends on, as plain numbers."""
        prec = torch.as_tensor(self.prior_precision).detach().reshape(-1).tolist()
        return (tuple(prec), float(self._H_factor))

    def _ensure_current(self) -> None:
        """Rebuild the factor if a hyperparameter changed since it was built.

        ``prior_precision``, ``sigma_noise`` and ``temperature`` all enter it;
        laplace-torch only notices a prior change, and only in ``la(x)``.
        """
        if getattr(self, "_sigma_key", None) != self._hyper_key():
            self._build_Sigma_inv()
        self._recompute_Sigma = False

    def _refresh_posterior(self) -> None:
        """laplace-torch 0.3's hook in ``la(x)``: rebuild silently when stale."""
        self._ensure_current()

    def __call__(
        self, x: torch.Tensor, pred_type: str = "gp", *args: Any, **kwargs: Any
    ) -> Any:
        """laplace-torch's ``la(x, pred_type='gp', ...)``, never with a stale factor.

        ``pred_type='glm'`` is accepted as the same linearised predictive (as
        :class:`~laplace_diffjac.ContextPosterior` does): in the function-space
        form the GLM predictive is the GP one.

        Returns
        -------
        torch.Tensor or tuple of torch.Tensor
            As laplace-torch's ``FunctionalLaplace.__call__``.

        Raises
        ------
        ValueError
            For ``pred_type`` other than ``'gp'`` or ``'glm'``.

        """
        if pred_type not in ("gp", "glm"):
            raise ValueError(
                f"LocationFunctionalLaplace predicts the linearised predictive, "
                f"pred_type='gp' or 'glm'; got pred_type={pred_type!r}."
            )
        self._ensure_current()
        return super().__call__(x, "gp", *args, **kwargs)

    def _glm_predictive_distribution(
        self, X: torch.Tensor, joint: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and latent covariance at ``X``, from per-layer factors if possible.

        The factor route (``structured=True``, a backend with
        ``jacobian_factors``, dependent outputs, tensor inputs) computes
        ``K** = s k(x*, x*)`` and ``K*M = s k(x*, Z)``, ``s`` the subset-of-data
        prior variance, from the factors (as :func:`~laplace_diffjac.kernels.ntk`),
        then
        ``K** − K*M (K_MM + Λ_MM⁻¹)⁻¹ K_M*`` as laplace-torch's
        ``functional_variance`` (``functional_covariance`` for ``joint``) does
        from the Jacobians; otherwise it is laplace-torch's method.

        Parameters
        ----------
        X : torch.Tensor
            ``(N*, *input_shape)`` test inputs.
        joint : bool, default=False
            The joint covariance of all test outputs.

        Returns
        -------
        f_mu : torch.Tensor
            ``(N*, C)``, or ``(N* C,)`` if ``joint``.
        f_var : torch.Tensor
            ``(N*, C, C)``, or ``(N* C, N* C)`` input-major if ``joint``;
            detached unless ``enable_backprop``.

        """
        backend = self.backend
        if not isinstance(X, torch.Tensor) or not self._factor_route_applies():
            return super()._glm_predictive_distribution(X, joint=joint)
        if not self._fits_whole(X, len(self.locations), self.enable_backprop, joint):
            return self._budgeted_predictive(X, joint)
        with torch.enable_grad():  # as laplace-torch 0.3's decorator
            factors = engine_factors(backend, X, self.enable_backprop)
            if self._location_factors is None:  # not held by a budgeted fit
                self._location_factors = engine_factors(
                    backend, self.locations.to(self._device), False
                )
            located = self._location_factors
            params = list(backend.params)
            unit = torch.ones((), dtype=factors.f.dtype, device=factors.f.device)
            scale = self.gp_kernel_prior_variance
            K_M_star = scale * factor_gram(factors, located, params, unit)
            if joint:
                K_star = scale * factor_gram(factors, factors, params, unit)
                f_var = K_star - self._build_K_star_M([K_M_star], joint=True)
                f_var = f_var.permute(0, 2, 1, 3).flatten(0, 1).flatten(1, 2)
                f_mu = factors.f.flatten()
            else:
                K_star = scale * factor_gram(factors, None, params, unit)
                f_var = K_star - self._build_K_star_M([K_M_star])
                f_mu = factors.f
        if not self.enable_backprop:
            return f_mu.detach(), f_var.detach()
        return f_mu, f_var

    def _fits_whole(
        self, x: torch.Tensor, n_held: int, graph: bool, joint: bool = False
    ) -> bool:
        """Whether ``x``'s factors and Grams fit the memory budget in one piece.

        Counted (:mod:`laplace_diffjac.kernels._feature_sizes`): ``x``'s factors
        while computed (with their graph if ``graph``), ``n_held`` held
        locations' factors, and the Grams' working memory against them and
        against ``x`` itself (all of it, kept for a gradient, if ``graph``).

        Returns
        -------
        bool
        """
        key = (tuple(x.shape[1:]), x.dtype, x.device)
        known = self.__dict__.setdefault("_sizes", {})  # per input layout
        if key not in known:
            known[key] = feature_sizes(self.backend, x, True)
        sizes = known[key]
        b, per_input = len(x), sizes.graph if graph else sizes.transient
        needs = b * per_input + n_held * sizes.features
        needs += sizes.gram(b, max(n_held, 1)) + sizes.gram(b, b if joint else 1)
        return needs <= get_memory_budget(x.device)

    def _budgeted_predictive(
        self, X: torch.Tensor, joint: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The factor route's predictive through the budgeted :func:`ntk`.

        The same Grams as :meth:`_glm_predictive_distribution`, in the memory
        budget's chunks (recomputed for a gradient with ``enable_backprop``:
        differentiable once); the mean is the network's output.

        Returns
        -------
        tuple of torch.Tensor
            As :meth:`_glm_predictive_distribution`.
        """
        backend, scale = self.backend, self.gp_kernel_prior_variance
        Z = self.locations.to(self._device)
        grad_mode = torch.enable_grad() if self.enable_backprop else torch.no_grad()
        with grad_mode:
            K_M_star = scale * ntk(backend, X, Z)
            f = self.model(X)
            if joint:
                K_star = scale * ntk(backend, X)
                f_var = K_star - self._build_K_star_M([K_M_star], joint=True)
                f_var = f_var.permute(0, 2, 1, 3).flatten(0, 1).flatten(1, 2)
                f_mu = f.flatten()
            else:
                K_star = scale * ntk_diag(backend, X)
                f_var = K_star - self._build_K_star_M([K_M_star])
                f_mu = f
        if not self.enable_backprop:
            return f_mu.detach(), f_var.detach()
        return f_mu, f_var

    def _build_K_star_M(
        self, K_M_star: list[torch.Tensor], joint: bool = False
    ) -> torch.Tensor:
        """``K*M (K_MM + Λ_MM⁻¹)⁻¹ K_M*`` with the output axes merged correctly.

        laplace-torch (0.2.3 and 0.3) reshapes the ``(N*, M, C, C)`` blocks
        ``[a, m, c, e] = J_c(x*_a) J_e(z_m)ᵀ`` to ``(N*, M·C, C)`` directly, which
        pairs ``m`` with the *test* output ``c``; ``K_MM`` and ``Λ_MM`` are ordered
        by ``(m, e)``. Swapping the two output axes first merges ``(m, e)``, as
        ``K_MM`` does. For ``C = 1`` and ``independent_outputs=True`` nothing
        changes. Only this class is affected; laplace-torch is not patched.
        The triangular solve is done once for all test inputs (laplace-torch's
        ``linalg.solve`` broadcasts and refactorises per test input).

        Parameters
        ----------
        K_M_star : list of torch.Tensor
            Blocks ``(N*, b, C, C)`` (or ``(N*, b, C)`` for independent outputs).
        joint : bool, default=False
            Cross-covariances between the test inputs.

        Returns
        -------
        torch.Tensor
            ``(N*, C, C)``, or ``(N*, N*, C, C)`` if ``joint`` (the
            independent-output shapes as laplace-torch).

        Raises
        ------
        RuntimeError
            Before ``fit`` (``output_hessian='full'``).

        """
        self._ensure_current()
        if self.independent_outputs:
            return super()._build_K_star_M(K_M_star, joint=joint)
        K = torch.cat(K_M_star, dim=1).permute(1, 3, 0, 2)  # [m, e, a, c]
        n_star, C = K.shape[2], K.shape[3]
        K = K.reshape(-1, n_star * C)  # one right-hand side per (a, c)
        if self.output_hessian == "diagonal":
            V = torch.linalg.solve_triangular(self.Sigma_inv, K, upper=False)
        else:
            if self._full_R is None or self._full_chol is None:
                raise RuntimeError("Call fit before predicting.")
            K = self._full_R @ K.to(torch.float64)
            V = torch.linalg.solve_triangular(self._full_chol, K, upper=False)
        V = V.to(self._dtype).reshape(-1, n_star, C).permute(1, 0, 2)  # [a, me, c]
        if joint:
            return torch.einsum("acm,bcn->abmn", V, V)
        return torch.einsum("bcm,bcn->bmn", V, V)

    def _build_Sigma_inv(self) -> None:
        """laplace-torch's factor, and with ``output_hessian='full'`` also ours.

        Ours is ``R = Λ_MM^{1/2}`` (block-diagonal, from the eigendecomposition of
        each ``C × C`` block, scaled by ``1 / (σ² T)`` and by ``N / M`` when
        reweighting) and the Cholesky factor of ``I + R K_MM R`` in float64.
        """
        super()._build_Sigma_inv()
        self._sigma_key = self._hyper_key()
        if self.output_hessian != "full" or self._lam_full is None:
            return
        weight = self.n_data / self.n_subset if self.reweight else 1.0
        lam = self._lam_full.to(self._device) * (float(self._H_factor) * weight)
        s, U = torch.linalg.eigh(lam)
        R = torch.block_diag(*(U * s.clamp_min(0).sqrt()[:, None, :]) @ U.mT)
        K = self.K_MM.to(torch.float64) * float(self.gp_kernel_prior_variance)
        eye = torch.eye(K.shape[0], dtype=torch.float64, device=K.device)
        self._full_R = R
        self._full_chol = torch.linalg.cholesky(eye + R @ K @ R)

    def state_dict(self) -> dict[str, Any]:
        """laplace-torch's state plus the locations; safe for ``weights_only=True``.

        The subset loader (a ``DataLoader`` in laplace-torch's state) is replaced
        by its batch size and rebuilt from the locations on loading.

        Returns
        -------
        dict
            Tensors and plain values only.

        """
        state = super().state_dict()
        state["train_loader"] = None
        state["sod_batch_size"] = int(self.train_loader.batch_size or 1)
        state["locations"] = self.locations
        state["reweight"] = bool(self.reweight)
        state["output_hessian"] = self.output_hessian
        state["lam_full"] = self._lam_full
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (laplace-torch's checks, then ours).

        Parameters
        ----------
        state_dict : dict
            From :meth:`state_dict`.

        Raises
        ------
        ValueError
            As laplace-torch (class, parameter count, likelihood), or if the
            locations' or the options' of the state differ from this object's.

        """
        if "locations" not in state_dict:
            raise ValueError("Not a LocationFunctionalLaplace state (no locations).")
        if tuple(state_dict["locations"].shape) != tuple(self.locations.shape):
            raise ValueError(
                f"The state has locations of shape "
                f"{tuple(state_dict['locations'].shape)}; this object "
                f"{tuple(self.locations.shape)}."
            )
        if (state_dict["reweight"], state_dict["output_hessian"]) != (
            self.reweight,
            self.output_hessian,
        ):
            raise ValueError("The state was saved with other reweight/output_hessian.")
        super().load_state_dict(state_dict)
        self.locations = state_dict["locations"].to(self._device)
        self._location_factors = None
        self._lam_full = state_dict["lam_full"]
        batch_size = state_dict["sod_batch_size"]
        loader = DataLoader(TensorDataset(self.locations), batch_size=batch_size)
        self.train_loader = self._get_SoD_data_loader(loader)
        self._build_Sigma_inv()
        self._recompute_Sigma = False

    def _get_SoD_data_loader(self, train_loader: DataLoader) -> DataLoader:
        """Locations with MAP pseudo-targets, batched like ``train_loader``."""
        Z = self.locations.to(self._device)
        with torch.no_grad():
            f = self.model(Z)
        y = f.argmax(dim=-1) if self.likelihood == "classification" else f
        return DataLoader(
            TensorDataset(Z, y), batch_size=train_loader.batch_size, shuffle=False
        )


def functional_laplace_on_locations(
    model: nn.Module,
    likelihood: str,
    locations: torch.Tensor,
    train_loader: DataLoader,
    **kwargs: Any,
) -> LocationFunctionalLaplace:
    """Build and fit a :class:`LocationFunctionalLaplace` in one call.

    Parameters
    ----------
    model : torch.nn.Module
        Trained network.
    likelihood : {'regression', 'classification'}
        The likelihood.
    locations : torch.Tensor
        Context locations ``(M, *input_shape)``.
    train_loader : DataLoader
        The training loader (its data set size sets ``N``).
    **kwargs
        Passed to :class:`LocationFunctionalLaplace`.

    Returns
    -------
    LocationFunctionalLaplace
        Fitted; call it as ``la(x, pred_type='gp')``.

    """
    la = LocationFunctionalLaplace(model, likelihood, locations, **kwargs)
    la.fit(train_loader)
    return la


def _location_parts(
    backend: Any,
    Z: torch.Tensor,
    params: list[torch.Tensor],
    offset: torch.Tensor,
    whole: bool,
) -> tuple[torch.Tensor, torch.Tensor, JacobianFactors | None]:
    """The locations' outputs ``f`` ``(M, C)``, ``J (μ₀ − θ*)`` and factors.

    ``whole``: the factors of all locations at once, returned for the Grams;
    otherwise chunk by chunk within the memory budget, the factors not kept.

    Returns
    -------
    tuple
        ``(f, shift, factors or None)``, detached.
    """
    if whole:
        factors = engine_factors(backend, Z, False)
        shift = factor_jvp(factors, params, offset).detach()
        return factors.f.detach(), shift, factors
    sizes = feature_sizes(backend, Z, True)
    chunk = max(1, int(get_memory_budget(Z.device) // (2 * sizes.transient)))
    outputs, shifts = [], []
    for part in Z.split(chunk):
        factors = engine_factors(backend, part, False)
        outputs.append(factors.f.detach())
        shifts.append(factor_jvp(factors, params, offset).detach())
        del factors
    return torch.cat(outputs), torch.cat(shifts), None
