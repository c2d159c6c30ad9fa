"""The posteriors compared, all on the same trained network of a seed.

Each method is a :class:`MethodSpec`: how to build a posterior at prior precision
``δ`` from the seed's context and the locations of its row, and whether its
evidence may choose ``δ``. ``MAP`` and ``FullLaplace`` need no locations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from laplace import Laplace, baselaplace

from laplace_diffjac import ContextPosterior, DiffBackPackGGN, LocationFunctionalLaplace

from .context import SeedContext
from .selection import set_prior_precision

__all__ = [
    "HAS_ELLA_VALLA",
    "LOCATION_METHODS",
    "METHODS",
    "LastLayerPosterior",
    "MethodSpec",
    "Row",
]


@dataclass
class Row:
    """Locations of one (seed, M) row: random subset, its labels, optimised."""

    m: int
    random: torch.Tensor
    random_labels: torch.Tensor
    optimised: torch.Tensor | None = None
    valla_iterations: int = 100


Builder = Callable[[SeedContext, Row, float], Any]


@dataclass(frozen=True)
class MethodSpec:
    """A posterior family and how its ``δ`` is chosen.

    ``selection``: ``'evidence'`` (its own marginal likelihood when it has one,
    else validation grid), ``'grid'`` (validation NLPD on the grid), ``'own'``
    (the method learns ``δ`` itself while fitting), ``'full'`` (the full-data
    Laplace's evidence ``δ``, the same for every such row: a comparison of
    locations at one common ``δ``). ``retune``: the posterior takes a new
    ``prior_precision`` after ``fit`` exactly (tested in
    ``tests/context/test_hyperparameters.py``), so the validation grid fits once.
    """

    name: str
    build: Builder
    selection: str
    locations: str  # 'random', 'optimised' or 'none' (once per seed, not per M)
    shared: bool = False  # build again at the chosen δ (see select_prior_precision)
    note: str = ""
    retune: bool = False  # set prior_precision after one fit instead of refitting


def _gp_subset(ctx: SeedContext, row: Row, delta: float) -> Any:
    la = Laplace(
        ctx.model,
        ctx.likelihood,
        subset_of_weights="all",
        hessian_structure="gp",
        n_subset=row.m,
        backend=DiffBackPackGGN,
        sigma_noise=ctx.sigma_noise,
        prior_precision=delta,
    )
    torch.manual_seed(20_000 + ctx.seed * 101 + row.m)  # its own subset draw
    la.fit(ctx.train_loader)
    return la


def _context(which: str) -> Builder:
    def build(ctx: SeedContext, row: Row, delta: float) -> Any:
        Z = row.random if which == "random" else row.optimised
        cp = ContextPosterior(
            ctx.model,
            ctx.likelihood,
            Z,
            sigma_noise=ctx.sigma_noise,
            prior_precision=delta,
        )
        return cp.fit(ctx.train_loader)

    return build


def _location_fl(which: str) -> Builder:
    def build(ctx: SeedContext, row: Row, delta: float) -> Any:
        Z = row.random if which == "random" else row.optimised
        full = ctx.likelihood == "classification"
        la = LocationFunctionalLaplace(
            ctx.model,
            ctx.likelihood,
            Z,
            output_hessian="full" if full else "diagonal",
            sigma_noise=ctx.sigma_noise,
            prior_precision=delta,
        )
        la.fit(ctx.train_loader)
        return la

    return build


def _with_common_delta(fit: Builder) -> tuple[Builder, Builder]:
    """``fit``, and a builder for its common-δ row that reuses the last fit.

    The common-δ row of a (seed, M, locations) comes right after the row that
    selects δ; that posterior (ContextPosterior, LocationFunctionalLaplace) takes a
    new ``prior_precision`` after ``fit`` exactly (tested in
    ``tests/context/test_hyperparameters.py``), so it is set to the common δ instead
    of fitted again; without such a fit (``--methods`` without it) it is fitted.
    """
    last: dict[tuple[int, int], Any] = {}

    def build(ctx: SeedContext, row: Row, delta: float) -> Any:
        posterior = fit(ctx, row, delta)
        last.clear()
        last[(id(ctx), row.m)] = posterior
        return posterior

    def at_delta(ctx: SeedContext, row: Row, delta: float) -> Any:
        posterior = last.pop((id(ctx), row.m), None)
        if posterior is None:
            return fit(ctx, row, delta)
        set_prior_precision(posterior, delta)
        return posterior

    return build, at_delta


#: (label, locations) -> (builder that selects δ, builder of the common-δ row)
_PAIRED = {
    (label, which): _with_common_delta(fit(which))
    for label, fit in (("CP", _context), ("LFL full-Λ", _location_fl))
    for which in ("random", "optimised")
}


class LastLayerPosterior:
    """laplace-torch's last-layer Laplace, predicting from full-network Jacobians.

    ``Laplace(..., subset_of_weights="last_layer", hessian_structure="full")``
    (``FullLLLaplace``). The last ``Linear`` layer's weight and bias are the last
    parameters of the network's parameter vector, so the last-layer Jacobian is the
    last ``n_params`` columns of the full one (checked against laplace-torch's own
    predictive in the study's tests).
    """

    def __init__(self, la: Any) -> None:
        self.la = la

    def functional_variance(self, jacobians: torch.Tensor) -> torch.Tensor:
        """Latent covariances ``(n, C, C)`` from full Jacobians ``(n, C, P)``."""
        return self.la.functional_variance(jacobians[..., -self.la.n_params :])

    def log_marginal_likelihood(self, prior_precision: Any = None) -> torch.Tensor:
        """laplace-torch's evidence of the last-layer posterior."""
        return self.la.log_marginal_likelihood(prior_precision=prior_precision)

    @property
    def prior_precision(self) -> Any:
        """The wrapped posterior's prior precision."""
        return self.la.prior_precision

    @prior_precision.setter
    def prior_precision(self, value: Any) -> None:
        self.la.prior_precision = value

    @property
    def sigma_noise(self) -> Any:
        """The wrapped posterior's observation noise."""
        return self.la.sigma_noise


def _last_layer(ctx: SeedContext, row: Row, delta: float) -> Any:
    la = Laplace(
        ctx.model,
        ctx.likelihood,
        subset_of_weights="last_layer",
        hessian_structure="full",
        backend=DiffBackPackGGN,
        sigma_noise=ctx.sigma_noise,
        prior_precision=delta,
    )
    la.fit(ctx.train_loader)
    return LastLayerPosterior(la)


def _ella() -> Builder:
    cache: dict[tuple, Any] = {}

    def build(ctx: SeedContext, row: Row, delta: float) -> Any:
        key = (id(ctx), row.m)
        if key not in cache:
            cache.clear()
            la = Laplace(
                ctx.model,
                ctx.likelihood,
                subset_of_weights="all",
                hessian_structure="gp",
                functional_approximation="nystrom",
                subsample_size=row.m,
                n_eigenvalues=row.m,
                backend=DiffBackPackGGN,
                sigma_noise=ctx.sigma_noise,
                seed=ctx.seed,
            )
            la.fit(ctx.train_loader)
            cache[key] = la
        la = cache[key]
        la.prior_precision = delta
        return la

    return build


def _valla(ctx: SeedContext, row: Row, delta: float) -> Any:
    classes = row.random_labels if ctx.likelihood == "classification" else None
    la = Laplace(
        ctx.model,
        ctx.likelihood,
        subset_of_weights="all",
        hessian_structure="gp",
        functional_approximation="variational",
        inducing_locations=row.random.clone(),
        inducing_classes=classes,
        backend=DiffBackPackGGN,
        sigma_noise=ctx.sigma_noise,
        prior_precision=delta,
        seed=ctx.seed,
    )
    la.fit(ctx.train_loader, iterations=row.valla_iterations, lr=1e-2)
    return la


#: laplace-torch 0.3 has ELLA and VaLLA; with 0.2.3 those rows are left out.
HAS_ELLA_VALLA = hasattr(baselaplace, "ELLA") and hasattr(baselaplace, "VaLLA")

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec(
            "LLLaplace",
            _last_layer,
            "evidence",
            "none",
            note="laplace-torch last-layer Laplace, full Hessian",
        ),
        MethodSpec(
            "LLLaplace (val-δ)",
            _last_layer,
            "grid",
            "none",
            note="the same, δ by validation NLPD",
            retune=True,
        ),
        MethodSpec(
            "GP-subset",
            _gp_subset,
            "evidence",
            "random",
            shared=True,  # refit at the chosen δ: its variance goes stale
            note="laplace-torch FunctionalLaplace, its own random subset",
        ),
        MethodSpec(
            "SFR-like CP (random)",
            _PAIRED["CP", "random"][0],
            "evidence",
            "random",
            note="ContextPosterior (DTC) through a random subset",
        ),
        MethodSpec(
            "GP-subset (val-δ)",
            _gp_subset,
            "grid",
            "random",
            shared=True,
            note="GP-subset, δ by validation NLPD (refitted per grid point)",
        ),
        MethodSpec(
            "SFR-like CP (random) (val-δ)",
            _context("random"),
            "grid",
            "random",
            note="ContextPosterior on the random subset, δ by validation NLPD",
            retune=True,
        ),
        MethodSpec(
            "LFL full-Λ (random)",
            _PAIRED["LFL full-Λ", "random"][0],
            "grid",
            "random",
            note="LocationFunctionalLaplace; evidence is of pseudo-targets",
            retune=True,
        ),
        MethodSpec(
            "ELLA",
            _ella(),
            "grid",
            "random",
            shared=True,
            note="laplace-torch 0.3 Nyström, subsample = eigenvalues = M",
        ),
        MethodSpec(
            "VaLLA",
            _valla,
            "own",
            "random",
            note="laplace-torch 0.3; learns δ, σ and Z by its own bound",
        ),
        MethodSpec(
            "CP (optimised)",
            _PAIRED["CP", "optimised"][0],
            "evidence",
            "optimised",
            note="ContextPosterior on optimize_locations(init=random)",
        ),
        MethodSpec(
            "CP (optimised) (val-δ)",
            _context("optimised"),
            "grid",
            "optimised",
            note="ContextPosterior on optimised Z, δ by validation NLPD",
            retune=True,
        ),
        MethodSpec(
            "LFL full-Λ (optimised)",
            _PAIRED["LFL full-Λ", "optimised"][0],
            "grid",
            "optimised",
            note="LocationFunctionalLaplace on optimised Z",
            retune=True,
        ),
        *(
            MethodSpec(
                f"{label} ({which}) at full δ",
                builders[1],
                "full",
                which,
                note=f"{label} at the full Laplace's evidence δ",
            )
            for (label, which), builders in _PAIRED.items()
        ),
    )
    if HAS_ELLA_VALLA or spec.name not in ("ELLA", "VaLLA")
}
LOCATION_METHODS = list(METHODS)
