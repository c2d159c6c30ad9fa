"""LaplaceBoTorch's and ContextBoTorch's predictions from one trained network.

The regret of a BO loop mixes the network, the posterior and the acquisition.
This script holds the network fixed: per function and seed it draws the same
Sobol design as ``bayesopt.py`` (``--initial`` points, more than the BO loop
starts with, so that the network has learned something), trains one network with
laplace-bayesopt's ``LaplaceBoTorch`` (its training, its KFAC posterior, its
post-hoc evidence tuning of the prior precision ``δ`` and the noise ``σ``), and
puts posteriors of this package on that network:

* ``LaplaceBoTorch``: laplace-bayesopt's own (network mean; KFAC GGN variance;
  ``σ²`` added to every prediction);
* ``exact, its δ σ``: the exact linearised GP on the design (the locations are
  the observations), dual mean, with LaplaceBoTorch's ``δ`` and ``σ``: only the
  posterior's structure differs (full GGN in function space against KFAC);
* ``exact``: the same with ``δ``, ``σ`` tuned by its own evidence;
* ``optimised M``: ``--locations`` optimised locations, as ``ContextBoTorch``'s
  ``locations='optimised'``;
* ``… + noise``: ``σ²`` added to every prediction, as LaplaceBoTorch does.

On ``--test`` uniform points of the cube it reports the predictive's negative
log likelihood of the true (standardised) function and the rank correlation of
the mean with it; at the cube's corners (``2^d``, at most 1024 of them) the mean
and standard deviation against those at the uniform points (a surrogate that
predicts more at the corners than inside seeks them); and, at the point each
surrogate's log expected improvement picks (``optimize_acqf`` as in
``bayesopt.py``), its true value, whether it improves on the best observation,
its gain over it (in standard deviations of the function), its share of
coordinates on the cube's faces, and whether it is a corner (every coordinate
within 0.01 of 0 or 1).

Usage::

    python benchmarks/bayesopt/same_network.py                # SAME_NETWORK.md
    python benchmarks/bayesopt/same_network.py --quick --out DIR
    # issue #44's sizes: the functions where ContextBoTorch stalled, and held out
    python benchmarks/bayesopt/same_network.py --functions levy six_hump_camel \
        dixon_price rastrigin three_hump_camel powell --seeds 0 1 2 3 4 5 6 7 8 9 \
        --initial 16 --raw-samples 64 --no-optimised --workers 2 \
        --out benchmarks/bayesopt/stall
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import pathlib
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace

import torch

HERE = pathlib.Path(__file__).resolve().parent


@dataclass(frozen=True)
class Settings:
    """The run's settings (recorded in the results)."""

    functions: tuple[str, ...] = ("branin", "hartmann", "ackley", "rosenbrock")
    seeds: tuple[int, ...] = (0, 1, 2)
    initial: int = 30
    test: int = 1000
    epochs: int = 1000
    width: int = 50
    locations: int = 100
    location_steps: int = 100
    marglik_iters: int = 100
    restarts: int = 5
    raw_samples: int = 256
    #: Also the posteriors on ``locations`` optimised locations (``optimised M``).
    optimised: bool = True


QUICK = Settings(
    functions=("branin",),
    seeds=(0,),
    initial=8,
    test=64,
    epochs=20,
    width=8,
    locations=6,
    location_steps=3,
    marglik_iters=5,
    restarts=2,
    raw_samples=16,
)


class _Fixed:
    """A BoTorch model: a context posterior on a given network, standardised Y."""

    def __new__(cls, posterior, transform, noise: bool):
        from botorch.models.model import Model
        from botorch.posteriors.gpytorch import GPyTorchPosterior
        from gpytorch.distributions import MultivariateNormal
        from linear_operator.operators import DenseLinearOperator

        class FixedPosteriorModel(Model):
            num_outputs = 1

            def posterior(self, X, output_indices=None, observation_noise=False,
                          posterior_transform=None, **kwargs):  # fmt: skip
                mean, cov = posterior.joint_predictive(X)
                if noise:
                    sigma2 = posterior.sigma_noise.to(cov) ** 2
                    cov = cov + sigma2 * torch.eye(cov.shape[-1], dtype=cov.dtype)
                dist = MultivariateNormal(mean[..., 0], DenseLinearOperator(cov))
                return transform.untransform_posterior(GPyTorchPosterior(dist))

        model = FixedPosteriorModel()
        model.context_posterior = posterior
        return model


def _surrogates(net, lbt, X, Y, s: Settings, seed: int) -> dict:
    """Name -> BoTorch model, all on ``net`` (``Y`` standardised as lbt's)."""
    from laplace_diffjac import ContextPosterior, DiffBackPackGGN
    from laplace_diffjac.bayesopt._surrogate import SurrogateSettings, choose_locations

    delta = lbt.bnn.prior_precision.detach().clone()
    sigma = lbt.bnn.sigma_noise.detach().clone()

    def posterior(Z, hyper):
        post = ContextPosterior(
            net, "regression", Z, enable_backprop=True, predictive_mean="dual",
            backend=DiffBackPackGGN,
        ).fit((X, Y))  # fmt: skip
        if hyper is None:
            post.optimize_prior_precision(
                method="marglik", n_steps=s.marglik_iters, learn_sigma_noise=True
            )
        else:
            post.prior_precision, post.sigma_noise = hyper
        return post

    settings = SurrogateSettings(
        lambda: net, None, s.epochs, 0.1, 1e-3, 10, s.locations, "optimised",
        torch.stack([torch.zeros(X.shape[-1]), torch.ones(X.shape[-1])]).to(X),
        s.location_steps, 512, s.marglik_iters, DiffBackPackGGN, seed,
    )  # fmt: skip
    exact_theirs = posterior(X.clone(), (delta, sigma))
    exact_own = posterior(X.clone(), None)
    transform = lbt.outcome_transform
    models = {
        "LaplaceBoTorch": lbt,
        "exact, its δ σ": _Fixed(exact_theirs, transform, False),
        "exact, its δ σ + noise": _Fixed(exact_theirs, transform, True),
        "exact": _Fixed(exact_own, transform, False),
        "exact + noise": _Fixed(exact_own, transform, True),
    }
    if s.optimised:
        Z = choose_locations(settings, net, X, torch.Generator().manual_seed(seed))
        optimised = posterior(Z, None)
        models[f"optimised {s.locations}"] = _Fixed(optimised, transform, False)
        models[f"optimised {s.locations} + noise"] = _Fixed(optimised, transform, True)
    return models


def _hyperparameters(model) -> dict:
    """The prior precision ``δ`` and noise ``σ`` of a surrogate's posterior."""
    posterior = model.bnn if hasattr(model, "bnn") else model.context_posterior
    return {
        "delta": float(posterior.prior_precision),
        "sigma": float(posterior.sigma_noise),
    }


def _corners(dim: int, limit: int = 1024) -> torch.Tensor:
    if 2**dim <= limit:
        rows = list(itertools.product((0.0, 1.0), repeat=dim))
        return torch.tensor(rows, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 2, (limit, dim), generator=g).double()


def _measure(model, best, X_test, f_test, corners, problem, s: Settings) -> dict:
    from botorch.acquisition import LogExpectedImprovement
    from botorch.optim import optimize_acqf
    from scipy.stats import spearmanr

    with torch.no_grad():
        post = model.posterior(X_test)
        mean, var = post.mean.squeeze(-1), post.variance.squeeze(-1)
        corner = model.posterior(corners)
        c_mean, c_sd = corner.mean.squeeze(-1), corner.variance.squeeze(-1).sqrt()
    scale = f_test.std()
    z = (f_test - mean) / var.sqrt()
    nll = 0.5 * (z**2 + torch.log(2 * torch.pi * var / scale**2))
    dim = X_test.shape[-1]
    bounds = torch.stack([torch.zeros(dim), torch.ones(dim)]).double()
    candidate, _ = optimize_acqf(
        LogExpectedImprovement(model, best_f=best), bounds, q=1,
        num_restarts=s.restarts, raw_samples=s.raw_samples,
    )  # fmt: skip
    candidate = candidate.detach()
    lo, hi = problem.bounds
    value = float(problem(lo + (hi - lo) * candidate))
    is_corner = bool(((candidate < 0.01) | (candidate > 0.99)).all())
    on_faces = (candidate <= 1e-9) | (candidate >= 1 - 1e-9)
    return {
        "pick_improves": value > float(best),
        "pick_gain_sd": (value - float(best)) / float(scale),
        "pick_on_faces": float(on_faces.double().mean()),
        "nll": float(nll.mean()),
        "spearman": float(spearmanr(mean.numpy(), f_test.numpy())[0]),
        "mean_inside": float(mean.mean()),
        "mean_corners": float(c_mean.mean()),
        "sd_inside": float(var.sqrt().mean()),
        "sd_corners": float(c_sd.mean()),
        "pick_value": value,
        "pick_is_corner": is_corner,
    }


def run_case(function: str, seed: int, s: Settings) -> list[dict]:
    """Every surrogate's measurements on one function and seed."""
    from bayesopt import _net_factory, _problem, initial_design  # same folder
    from botorch.models.transforms.outcome import Standardize
    from laplace_bayesopt.botorch import LaplaceBoTorch

    torch.set_num_threads(1)
    problem = _problem(function)
    dim = problem.dim
    X, Y, evaluate = initial_design(problem, s.initial, seed)
    torch.manual_seed(seed)
    lbt = LaplaceBoTorch(
        _net_factory(dim, s.width), X, Y, outcome_transform=Standardize(m=1),
        n_epochs=s.epochs, posthoc_marglik_iters=s.marglik_iters,
    )  # fmt: skip
    net = lbt.net
    Y_t = lbt.train_Y
    g = torch.Generator().manual_seed(10_000 + seed)
    X_test = torch.rand(s.test, dim, generator=g, dtype=torch.float64)
    f_test = evaluate(X_test).squeeze(-1)
    corners = _corners(dim)
    rows = []
    for name, model in _surrogates(net, lbt, X, Y_t, s, seed).items():
        t = time.process_time()
        row = _measure(model, Y.max(), X_test, f_test, corners, problem, s)
        row.update(_hyperparameters(model))
        row.update(function=function, seed=seed, surrogate=name,
                   measure_s=time.process_time() - t)  # fmt: skip
        rows.append(row)
    return rows


def _case(case: tuple[str, int, Settings]) -> list[dict]:
    """``run_case`` with the warnings of the libraries silenced (a worker's job)."""
    sys.path.insert(0, str(HERE))  # a spawned worker imports bayesopt from here
    function, seed, s = case
    with warnings.catch_warnings():
        # laplace-bayesopt's KFAC casts a tensor with a gradient to a float and
        # BoTorch reports restarts that stopped early: the BO benchmark records
        # these; here they are not what is measured.
        warnings.simplefilter("ignore")
        rows = run_case(function, seed, s)
    print(f"{time.strftime('%H:%M:%S')} {function} {seed}", flush=True)
    return rows


def report(rows: list[dict], s: Settings) -> str:
    """Markdown: per function and surrogate, means over seeds."""
    from statistics import fmean, median

    lines = [
        "# One network, two posteriors",
        "",
        "Generated by `python benchmarks/bayesopt/same_network.py`; settings: "
        f"`{json.dumps(asdict(s))}`. Means over seeds. NLL: the predictive's "
        "negative log likelihood of the true function at uniform points (the "
        "function standardised); ρ: Spearman's rank correlation of the mean "
        "with the function; mean and sd at the cube's corners against the "
        "uniform points (in the function's units); the acquisition's pick: its "
        "true value, the share of seeds in which it improves on the best "
        "observation, the median over seeds of its gain over that observation "
        "(in standard deviations of the function at the uniform points), the "
        "share of its coordinates on the cube's faces, and the share of seeds "
        "in which it is a corner; the posterior's prior precision δ and noise σ "
        "(standardised units).",
        "",
        "| function | surrogate | NLL | ρ | mean inside | mean corners | "
        "sd inside | sd corners | pick value | pick improves | pick gain (sd) | "
        "pick on faces | pick at a corner | δ | σ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["function"], r["surrogate"]) for r in rows},
                  key=lambda k: (s.functions.index(k[0]), k[1]))  # fmt: skip
    for function, name in keys:
        rs = [r for r in rows if r["function"] == function and r["surrogate"] == name]

        def m(key: str, rs=rs) -> float:
            return fmean(float(r[key]) for r in rs)

        lines.append(
            f"| {function} | {name} | {m('nll'):.3g} | {m('spearman'):.2f} | "
            f"{m('mean_inside'):.3g} | {m('mean_corners'):.3g} | "
            f"{m('sd_inside'):.3g} | {m('sd_corners'):.3g} | "
            f"{m('pick_value'):.3g} | {m('pick_improves'):.0%} | "
            f"{median(r['pick_gain_sd'] for r in rs):.2g} | "
            f"{m('pick_on_faces'):.0%} | {m('pick_is_corner'):.0%} | "
            f"{m('delta'):.3g} | {m('sigma'):.3g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=HERE)
    parser.add_argument("--functions", nargs="+")
    parser.add_argument("--seeds", nargs="+", type=int)
    parser.add_argument("--initial", type=int)
    parser.add_argument("--raw-samples", type=int)
    parser.add_argument("--no-optimised", action="store_true")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    s = QUICK if args.quick else Settings()
    if args.functions:
        s = replace(s, functions=tuple(args.functions))
    if args.seeds:
        s = replace(s, seeds=tuple(args.seeds))
    if args.initial:
        s = replace(s, initial=args.initial)
    if args.raw_samples:
        s = replace(s, raw_samples=args.raw_samples)
    if args.no_optimised:
        s = replace(s, optimised=False)
    cases = [(function, seed, s) for function in s.functions for seed in s.seeds]
    if args.workers == 1:
        results = [_case(case) for case in cases]
    else:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            results = pool.map(_case, cases)
    rows = [row for result in results for row in result]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "same_network.json").write_text(
        json.dumps({"settings": asdict(s), "rows": rows}, indent=1)
    )
    (args.out / "SAME_NETWORK.md").write_text(report(rows, s))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
