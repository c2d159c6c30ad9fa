"""Run every method of one (data set, seed) and turn each into a result row."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from laplace_diffjac import optimize_locations

from .context import SeedContext, random_subset
from .methods import METHODS, MethodSpec, Row
from .metrics import log_var_error, share_below
from .predictive import latent_variance, predictive_metrics
from .selection import Selection, select_prior_precision, sigma_of

__all__ = ["Probe", "StudyConfig", "evaluate_seed"]

#: ``probe(var_of, sigma, var_test)``: extra metrics of a fitted posterior, from
#: ``var_of(probe_set) -> (n, C)`` latent variances of the probe's own input sets,
#: the posterior's noise and its clean-test variances (``probes.py``).
Probe = Callable[[Callable[[Any], torch.Tensor], float, torch.Tensor], dict[str, Any]]


@dataclass(frozen=True)
class StudyConfig:
    """Sizes of the study (``--quick`` shrinks them); why these: ``README.md``."""

    fractions: tuple[float, ...] = (0.01, 0.02, 0.05, 0.10, 0.20)
    methods: tuple[str, ...] = tuple(METHODS)
    steps: int = 50
    batch_size: int = 128
    valla_iterations: int = 10
    grid: tuple[float, ...] = tuple(10.0**k for k in range(-2, 7))
    part: str = "main"  # 'main', or a part of ``probes.PARTS`` (its data and probe)


def full_metrics(ctx: SeedContext, delta: float) -> dict[str, Any]:
    var = ctx.full.latent_variance(ctx.proj_test, delta)
    return {
        **predictive_metrics(
            ctx.likelihood, ctx.f_test, var, ctx.split.y_test, ctx.sigma_noise
        ),
        "delta": delta,
    }


def _full_validation_delta(ctx: SeedContext, grid: tuple[float, ...]) -> float:
    """The grid δ of the full Laplace with the lowest validation NLPD."""

    def score(delta: float) -> float:
        var = ctx.full.latent_variance(ctx.proj_val, delta)
        y, sigma = ctx.split.y_val, ctx.sigma_noise
        return predictive_metrics(ctx.likelihood, ctx.f_val, var, y, sigma)["nlpd"]

    return min(grid, key=score)


def _full_row(ctx: SeedContext, delta: float, how: str, select_s: float, probe):
    start = time.perf_counter()
    row = {**full_metrics(ctx, delta), "selection": how}
    row.update(
        log_var_error=0.0, share_below=0.0, predict_s=time.perf_counter() - start
    )
    row["fit_s"] = ctx.times["full_fit"] + select_s
    if probe is not None:
        var = ctx.full.latent_variance(ctx.proj_test, delta)
        V = ctx.full.eigenvectors
        row["probe"] = probe(
            lambda s: ctx.full.latent_variance(s.projected(V), delta),
            ctx.sigma_noise,
            var,
        )
    return row


def _base_rows(ctx: SeedContext, grid: tuple[float, ...], probe) -> list[dict]:
    """MAP, the full Laplace at its evidence δ and at its validation δ."""
    zero = torch.zeros_like(ctx.f_test, dtype=torch.float64)
    y, sigma = ctx.split.y_test, ctx.sigma_noise
    map_row = {
        "method": "MAP",
        **predictive_metrics(ctx.likelihood, ctx.f_test, zero, y, sigma),
        "selection": "-",
    }
    if probe is not None:
        map_row["probe"] = probe(
            lambda s: torch.zeros_like(s.f, dtype=torch.float64), sigma, zero
        )
    rows = [map_row]
    for method, how, choose in (
        ("FullLaplace", "evidence (exact, eigenvalues)", ctx.full.best_delta),
        ("FullLaplace (val-δ)", "val-grid", lambda: _full_validation_delta(ctx, grid)),
    ):
        start = time.perf_counter()
        delta = choose()
        row = _full_row(ctx, delta, how, time.perf_counter() - start, probe)
        rows.append({"method": method, **row})
    return rows


def _optimised(ctx: SeedContext, row: Row, steps: int, batch: int, delta: float):
    kwargs: dict[str, Any] = {}
    if "evaluate_full" in inspect.signature(optimize_locations).parameters:
        kwargs["evaluate_full"] = False  # once the optimiser offers the switch
    start, cpu = time.perf_counter(), time.process_time()
    result = optimize_locations(
        ctx.model,
        ctx.likelihood,
        (ctx.split.x_train, ctx.split.y_train),
        m=row.m,
        init=row.random,
        prior_precision=delta,
        sigma_noise=ctx.sigma_noise,
        steps=steps,
        batch_size=batch,
        seed=30_000 + ctx.seed,  # a stream apart from the subset's
        progress_bar=False,
        **kwargs,
    )
    times = (time.perf_counter() - start, time.process_time() - cpu)
    return result.locations, times


def _method_row(
    spec: MethodSpec, ctx: SeedContext, row: Row, grid, init_delta, probe=None
):
    start, cpu = time.perf_counter(), time.process_time()
    if spec.selection == "own":  # learns δ while fitting: one fit, no grid
        posterior = spec.build(ctx, row, init_delta)
        delta = torch.as_tensor(posterior.prior_precision).detach()
        sel = Selection(
            posterior, float(delta.reshape(-1)[0]), "own objective (in fit)"
        )
    elif spec.selection == "full":  # one common δ: the full Laplace's evidence
        posterior = spec.build(ctx, row, init_delta)
        sel = Selection(posterior, init_delta, "full Laplace's evidence")
    else:
        sel = select_prior_precision(
            lambda d: spec.build(ctx, row, d),
            ctx,
            list(grid),
            use_evidence=spec.selection == "evidence",
            initial=init_delta,
            shared=spec.shared,
            retune=spec.retune,
        )
    fit_s, fit_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    var = latent_variance(sel.posterior, ctx.jac_test)
    predict_s, predict_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    sigma = sigma_of(sel.posterior, ctx)
    ref = ctx.full.latent_variance(ctx.proj_test, sel.delta, sigma)
    extra = {}
    if probe is not None:
        start = time.perf_counter()
        extra["probe"] = probe(
            lambda s: latent_variance(sel.posterior, s.jac), sigma, var
        )
        extra["probe_s"] = time.perf_counter() - start
    return {
        **extra,
        "method": spec.name,
        **predictive_metrics(ctx.likelihood, ctx.f_test, var, ctx.split.y_test, sigma),
        "delta": sel.delta,
        "selection": sel.how,
        "log_var_error": log_var_error(var, ref),
        "share_below": share_below(var, ref),
        "fit_s": fit_s,
        "predict_s": predict_s,
        "fit_cpu_s": fit_cpu_s,
        "predict_cpu_s": predict_cpu_s,
    }


def evaluate_seed(
    ctx: SeedContext,
    config: StudyConfig,
    on_method: Callable[[str], None] | None = None,
    on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
    probe: Probe | None = None,
) -> list[dict[str, Any]]:
    """All rows of one (data set, seed): MAP, FullLaplace and every method at every M.

    Parameters
    ----------
    ctx : SeedContext
        Trained network and references.
    config : StudyConfig
        Sizes.
    on_method : callable, optional
        Called with a label after each method (progress).
    on_rows : callable, optional
        Called with all rows so far after each method (incremental writing).
    probe : callable, optional
        Extra metrics of every posterior on other inputs (:data:`Probe`), stored
        in each row's ``probe``.

    Returns
    -------
    list of dict
        One row per (method, M), methods without locations once (no M); a method
        that raises gets a row with ``error``.

    """
    rows = _base_rows(ctx, config.grid, probe)
    delta_full = rows[1]["delta"]
    n = ctx.split.x_train.shape[0]
    empty = torch.zeros(0)
    for name in [m for m in config.methods if METHODS[m].locations == "none"]:
        out = _guarded(
            METHODS[name], ctx, Row(0, empty, empty), config, delta_full, probe
        )
        rows.append(out)
        _report(rows, out, on_method, on_rows)
    for frac in config.fractions:
        m = max(2, round(frac * n))
        idx = random_subset(n, m, ctx.seed)
        row = Row(
            m,
            ctx.split.x_train[idx].clone(),
            ctx.split.y_train[idx].clone(),
            valla_iterations=config.valla_iterations,
        )
        _rows_at(ctx, row, frac, config, delta_full, probe, rows, on_method, on_rows)
    return rows


def _rows_at(ctx, row, frac, config, delta_full, probe, rows, on_method, on_rows):
    """Append the rows of every method with locations at one M (``row.m``)."""
    search_s = search_cpu_s = None
    for name in config.methods:
        spec = METHODS[name]
        if spec.locations == "none":
            continue
        if spec.locations == "optimised" and row.optimised is None:
            row.optimised, (search_s, search_cpu_s) = _optimised(
                ctx, row, config.steps, config.batch_size, delta_full
            )
        out = _guarded(spec, ctx, row, config, delta_full, probe)
        out.update(m=row.m, fraction=frac)
        if spec.locations == "optimised":
            out["search_s"], out["search_cpu_s"] = search_s, search_cpu_s
        rows.append(out)
        _report(rows, out, on_method, on_rows)


def _guarded(spec, ctx, row, config, delta_full, probe) -> dict[str, Any]:
    """The method's row, or a row with its ``error`` (the study goes on)."""
    try:
        return _method_row(spec, ctx, row, config.grid, delta_full, probe)
    except Exception as err:  # recorded, the study goes on
        return {"method": spec.name, "error": f"{type(err).__name__}: {err}"}


def _report(rows, out, on_method, on_rows) -> None:
    if on_rows is not None:
        on_rows(rows)
    if on_method is not None:
        label = f"M={out['m']}" if "m" in out else ""
        on_method(f"{out['method']} {label} (fit {out.get('fit_s', 0.0):.0f} s)")
