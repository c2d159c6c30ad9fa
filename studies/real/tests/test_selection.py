"""Prior-precision selection (evidence, validation grid) and the common-δ rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from studies.real.context import SeedContext
from studies.real.data import load_split
from studies.real.methods import Row, _with_common_delta
from studies.real.metrics import gaussian_nlpd
from studies.real.selection import select_prior_precision


class _Fake:
    """Posterior whose latent variance is ``1/δ`` everywhere."""

    def __init__(self, delta: float) -> None:
        self.prior_precision = delta

    def functional_variance(self, Js: torch.Tensor) -> torch.Tensor:
        n, c, _ = Js.shape
        return torch.eye(c).expand(n, c, c) / self.prior_precision


class _FakeEvidence(_Fake):
    """Evidence ``−(log10 δ − log10 42)²``: its maximiser is ``δ = 42``."""

    def log_marginal_likelihood(self, prior_precision: torch.Tensor) -> torch.Tensor:
        self.prior_precision = float(prior_precision)
        return -((prior_precision.log10() - math.log10(42.0)) ** 2).sum()


class _FakeRefuses(_Fake):
    def log_marginal_likelihood(self, prior_precision: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _ctx() -> SeedContext:
    s = load_split("diabetes", 68)
    n = s.x_val.shape[0]
    return SeedContext(
        split=s,
        seed=0,
        model=torch.nn.Identity(),
        sigma_noise=0.5,
        train_loader=None,
        full=None,  # type: ignore[arg-type]
        jac_val=torch.zeros(n, 1, 3),
        jac_test=torch.zeros(1, 1, 3),
        f_val=s.y_val + 0.3,
        f_test=torch.zeros(1, 1),
        proj_val=torch.zeros(1),
        proj_test=torch.zeros(1),
    )


def test_selection_by_validation_grid_picks_the_lowest_nlpd() -> None:
    ctx = _ctx()
    grid = [0.1, 1.0, 10.0, 100.0]
    sel = select_prior_precision(_Fake, ctx, grid)
    scores = [
        gaussian_nlpd(
            ctx.f_val, torch.full_like(ctx.f_val, 1 / d + 0.25), ctx.split.y_val
        )
        for d in grid
    ]
    assert sel.how == "val-grid"
    assert sel.delta == grid[int(np.argmin(scores))]


def test_selection_by_grid_with_retune_fits_once_and_agrees() -> None:
    # a posterior that takes a new prior precision after fit is fitted once
    ctx, built = _ctx(), []

    def build(delta: float) -> _Fake:
        built.append(delta)
        return _Fake(delta)

    grid = [0.1, 1.0, 10.0, 100.0]
    sel = select_prior_precision(build, ctx, grid, use_evidence=False, retune=True)
    assert built == [grid[0]]
    assert sel.delta == select_prior_precision(_Fake, ctx, grid).delta
    assert float(sel.posterior.prior_precision) == sel.delta  # left at the choice


def test_common_delta_row_retunes_the_last_fit_of_its_pair() -> None:
    fits = []

    def fit(ctx, row, delta):
        fits.append(delta)
        return _Fake(delta)

    build, at_delta = _with_common_delta(fit)
    ctx, row = _ctx(), Row(3, torch.zeros(3, 1), torch.zeros(3))
    first = build(ctx, row, 5.0)
    again = at_delta(ctx, row, 2.0)
    assert again is first and float(again.prior_precision) == 2.0 and fits == [5.0]
    fresh = at_delta(ctx, row, 3.0)  # used up: fitted afresh
    assert fresh is not first and fits == [5.0, 3.0]


def test_selection_prefers_evidence_and_falls_back() -> None:
    ctx = _ctx()
    grid = [10.0**k for k in range(-2, 7)]
    sel = select_prior_precision(_FakeEvidence, ctx, grid)
    assert sel.how == "evidence"
    assert sel.delta == pytest.approx(42.0, rel=0.07)  # the search resolution
    assert float(sel.posterior.prior_precision) == pytest.approx(sel.delta)
    edge = select_prior_precision(_FakeEvidence, ctx, [1.0, 2.0])
    assert edge.delta == pytest.approx(2.0, rel=0.07)  # maximiser at the range's end
    assert select_prior_precision(_FakeRefuses, ctx, [1.0, 2.0]).how == "val-grid"
    off = select_prior_precision(_FakeEvidence, ctx, [1.0, 2.0], use_evidence=False)
    assert off.how == "val-grid"


def test_selection_rebuilds_at_the_chosen_delta_when_shared() -> None:
    # laplace-torch 0.3's FunctionalLaplace goes stale when δ changes after fit:
    # with shared=True the evidence's choice is fitted afresh
    ctx, built = _ctx(), []

    def build(delta: float) -> _FakeEvidence:
        built.append(delta)
        return _FakeEvidence(delta)

    sel = select_prior_precision(
        build, ctx, [10.0**k for k in range(-2, 7)], shared=True
    )
    assert len(built) == 2 and built[-1] == sel.delta
    assert sel.posterior.prior_precision == sel.delta  # the fresh object
