"""The real-data study (``benchmarks/real``): metrics, references, splits, selection,
report aggregation, and ``--quick`` end to end.

Metrics are checked against hand computations or scipy; the full-Laplace reference
against laplace-torch's ``FullLaplace`` itself.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.real.context import SeedContext
from benchmarks.real.data import DATASETS, load_split
from benchmarks.real.metrics import (
    accuracy,
    ece,
    gaussian_nlpd,
    log_var_error,
    nlpd,
    rmse,
    share_below,
)
from benchmarks.real.predictive import probit
from benchmarks.real.reference import FullReference
from benchmarks.real.report import aggregate
from benchmarks.real.selection import select_prior_precision
from benchmarks.real.training import make_mlp
from laplace_diffjac import DiffBackPackGGN

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- metrics


def test_nlpd_accuracy_by_hand() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.5, 0.4, 0.1]])
    y = torch.tensor([0, 2, 1])
    assert nlpd(probs, y) == pytest.approx(
        -(math.log(0.7) + math.log(0.6) + math.log(0.4)) / 3
    )
    assert accuracy(probs, y) == pytest.approx(2 / 3)


def test_gaussian_nlpd_and_rmse_against_scipy() -> None:
    f64 = torch.float64
    mean = torch.tensor([[0.5], [-1.0], [2.0]], dtype=f64)
    var = torch.tensor([[0.25], [2.0], [1.0]], dtype=f64)
    y = torch.tensor([[0.0], [0.5], [2.5]], dtype=f64)
    ref = -stats.norm.logpdf(y.numpy(), mean.numpy(), np.sqrt(var.numpy())).mean()
    assert gaussian_nlpd(mean, var, y) == pytest.approx(float(ref), rel=1e-12)
    assert rmse(mean, y) == pytest.approx(math.sqrt((0.25 + 2.25 + 0.25) / 3))


def test_ece_by_hand() -> None:
    # top-label confidences 0.95, 0.92, 0.55, 0.52, 0.31 (classes 0,0,1,1,2)
    probs = torch.tensor(
        [
            [0.95, 0.03, 0.02],  # bin 10, correct
            [0.92, 0.05, 0.03],  # bin 10, wrong
            [0.20, 0.55, 0.25],  # bin 6, correct
            [0.28, 0.52, 0.20],  # bin 6, wrong
            [0.34, 0.35, 0.31],  # bin 4, top label 1 with 0.35, wrong
        ]
    )
    y = torch.tensor([0, 1, 1, 0, 2])
    bin10 = 2 / 5 * abs(0.5 - (0.95 + 0.92) / 2)
    bin6 = 2 / 5 * abs(0.5 - (0.55 + 0.52) / 2)
    bin4 = 1 / 5 * abs(0.0 - 0.35)
    assert ece(probs, y) == pytest.approx(bin10 + bin6 + bin4, rel=1e-6)
    perfect = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert ece(perfect, torch.tensor([0, 1])) == 0.0


def test_log_var_error_and_share_below_by_hand() -> None:
    full = torch.tensor([[1.0, 2.0], [4.0, 0.5]])
    var = torch.tensor([[math.e, 2.0], [4.0 / math.e**2, 0.5]])
    assert log_var_error(var, full) == pytest.approx((1 + 0 + 2 + 0) / 4)
    assert share_below(var, full) == pytest.approx(1 / 4)


def test_probit_by_hand() -> None:
    f = torch.tensor([[1.0, -1.0]])
    var = torch.tensor([[8 / math.pi, 0.0]])  # kappa = 1/sqrt(2), 1
    logits = torch.tensor([1 / math.sqrt(2), -1.0])
    assert torch.allclose(probit(f, var)[0], logits.double().softmax(0))


# ------------------------------------------------------ data and splits


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_split_is_70_15_15_standardised_and_disjoint(name: str) -> None:
    s = load_split(name, 68)
    n = sum(t.shape[0] for t in (s.x_train, s.x_val, s.x_test))
    assert abs(s.x_test.shape[0] - 0.15 * n) <= 1
    assert abs(s.x_val.shape[0] - 0.15 * n) <= 1
    assert torch.allclose(s.x_train.mean(0), torch.zeros(1), atol=1e-5)
    sd = s.x_train.std(0, unbiased=False)
    assert torch.all(((sd - 1).abs() < 1e-4) | (sd == 0))
    rows = {tuple(r.tolist()) for r in s.x_train}
    assert not any(tuple(r.tolist()) in rows for r in s.x_test)
    again = load_split(name, 68)
    assert torch.equal(again.x_test, s.x_test)
    assert not torch.equal(load_split(name, 117).x_test, s.x_test)
    if s.task == "classification":
        for part in (s.y_val, s.y_test):
            share = torch.bincount(part, minlength=s.n_outputs) / part.numel()
            train = torch.bincount(s.y_train, minlength=s.n_outputs) / s.y_train.numel()
            assert torch.all((share - train).abs() < 0.03)


# ------------------------------------------------- full-Laplace reference


def _small_full(task: str) -> tuple[FullReference, torch.nn.Module, DataLoader]:
    name = "wine" if task == "classification" else "diabetes"
    s = load_split(name, 68)
    torch.manual_seed(0)
    model = make_mlp(s.x_train.shape[1], s.n_outputs, width=6).eval()
    loader = DataLoader(TensorDataset(s.x_train, s.y_train), batch_size=64)
    return (
        FullReference(
            model, task, loader, sigma_noise=0.7 if task == "regression" else 1.0
        ),
        model,
        loader,
    )


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_reference_matches_full_laplace(task: str) -> None:
    ref, model, _ = _small_full(task)
    la = ref.la
    x = load_split("wine" if task == "classification" else "diabetes", 68).x_test[:7]
    Js, _ = DiffBackPackGGN(model, task).jacobians(x)
    proj = Js.double() @ ref.eigenvectors
    for delta in (0.3, 3.0):
        la.prior_precision = delta
        expected = float(la.log_marginal_likelihood())
        assert ref.log_evidence(delta) == pytest.approx(expected, rel=1e-4)
        var = la.functional_variance(Js).diagonal(dim1=1, dim2=2).double()
        assert torch.allclose(ref.latent_variance(proj, delta), var, rtol=1e-3)
    best = ref.best_delta()
    assert ref.log_evidence(best) >= ref.log_evidence(best * 1.05)
    assert ref.log_evidence(best) >= ref.log_evidence(best / 1.05)


# ---------------------------------------------------------- selection


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
    from benchmarks.real.methods import Row, _with_common_delta

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


def test_task_order_covers_every_task_once_largest_data_set_last() -> None:
    from benchmarks.real.runner import task_order

    order = task_order(["big", "a", "b"], [1, 2, 3])
    assert sorted(order) == sorted((d, s) for d in ("big", "a", "b") for s in (1, 2, 3))
    assert order[:3] == [("big", 1), ("a", 1), ("b", 1)]
    assert order[-2:] == [("big", 2), ("big", 3)]


def test_aggregate_mean_and_sample_std() -> None:
    rows = [
        {
            "dataset": "d",
            "method": "A",
            "fraction": 0.1,
            "m": 3,
            "nlpd": v,
            "selection": "x",
        }
        for v in (1.0, 2.0, 4.0)
    ] + [{"dataset": "d", "method": "A", "fraction": 0.1, "m": 3, "error": "E: e"}]
    (agg,) = aggregate(rows)
    assert agg["nlpd"][0] == pytest.approx(7 / 3)
    assert agg["nlpd"][1] == pytest.approx(np.std([1.0, 2.0, 4.0], ddof=1))
    assert agg["n_seeds"] == 3 and agg["errors"] == ["E: e"]


def _agg(ds: str, method: str, frac: float, nlpd: float, lv: float) -> dict:
    return {
        "dataset": ds,
        "method": method,
        "fraction": frac,
        "nlpd": [nlpd, 0.0],
        "log_var_error": [lv, 0.0],
    }


def test_criteria_by_hand() -> None:
    from benchmarks.real.criteria import check_criteria, criteria_markdown

    aggs = [
        # digits 1 %: CP optimised better in both; LFL optimised worse NLPD
        _agg("digits", "SFR-like CP (random)", 0.01, 0.50, 0.30),
        _agg("digits", "CP (optimised)", 0.01, 0.40, 0.20),
        _agg("digits", "LFL full-Λ (random)", 0.01, 0.20, 1.00),
        _agg("digits", "LFL full-Λ (optimised)", 0.01, 0.21, 0.90),
        # digits 20 %: log-var worse but M > 10 %, so not required
        _agg("digits", "SFR-like CP (random)", 0.20, 0.12, 0.10),
        _agg("digits", "CP (optimised)", 0.20, 0.12, 0.15),
        _agg("digits", "GP-subset", 0.20, 0.01, 0.0),  # not ours: not the best row
    ]
    out = check_criteria(aggs)
    assert out["nlpd_never_worse"] is False
    assert out["nlpd_failures"] == ["digits M=1% LocationFunctionalLaplace"]
    assert out["log_var_better_m_le_10"] is True
    by = {(p["fraction"], p["posterior"]): p for p in out["pairs"]}
    assert by[(0.20, "ContextPosterior")]["log_var_better"] is None
    assert by[(0.01, "ContextPosterior")]["nlpd"]["diff"] == pytest.approx(-0.10)
    sfr = {s["fraction"]: s for s in out["sfr"]}
    assert sfr[0.01]["best_ours"] == "LFL full-Λ (random)" and sfr[0.01]["beats_sfr"]
    assert sfr[0.20]["best_ours_nlpd"] == 0.12 and not sfr[0.20]["beats_sfr"]
    assert out["sfr_behind"] == ["M=20%"]
    assert "**FAILED**" in "\n".join(criteria_markdown(out))
    assert out["common_delta"]["pairs"] == []  # no common-δ rows given
    common = [
        _agg("digits", "CP (random) at full δ", 0.01, 0.50, 0.30),
        _agg("digits", "CP (optimised) at full δ", 0.01, 0.45, 0.35),
    ]
    out = check_criteria(aggs + common)["common_delta"]
    assert [p["posterior"] for p in out["pairs"]] == ["ContextPosterior"]
    assert out["nlpd_never_worse"] is True and out["log_var_better_m_le_10"] is False
    assert out["log_var_failures"] == ["digits M=1% ContextPosterior"]
    assert "one common δ" in "\n".join(criteria_markdown(check_criteria(aggs + common)))


def test_load_records_prefers_finished_then_partial(tmp_path: Path) -> None:
    from benchmarks.real.runner import load_records

    (tmp_path / "a_1.json").write_text(json.dumps({"meta": {"k": "done"}, "rows": []}))
    (tmp_path / "a_1.partial.json").write_text(json.dumps({"meta": {"k": "p"}}))
    (tmp_path / "b_1.partial.json").write_text(
        json.dumps({"meta": {"k": "partial"}, "rows": []})
    )
    got = load_records(tmp_path, [("a", 1), ("b", 1), ("c", 1)])
    assert [r["meta"]["k"] for r in got] == ["done", "partial"]


# ---------------------------------------------------------- end to end


@pytest.mark.slow
def test_quick_study_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.real",
            "--quick",
            "--workers",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = ("RESULTS.md", "results.json", "run.json", "nlpd_vs_m.png", "nlpd_wine.png")
    for name in (*names, "nlpd_diabetes.png"):
        assert (tmp_path / name).stat().st_size > 0
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["rows"]
    assert not [r for r in rows if "error" in r]
    from benchmarks.real.methods import METHODS

    for ds in ("wine", "diabetes"):
        got = {(r["method"], r.get("fraction")) for r in rows if r["dataset"] == ds}
        want = {(m, f) for m in METHODS for f in (0.05, 0.2)}
        assert want | {("MAP", None), ("FullLaplace", None)} == got
    for r in rows:
        assert math.isfinite(r["nlpd"])
        if r["method"] not in ("MAP",):
            assert r["delta"] > 0 and 0 <= r["share_below"] <= 1
            assert r["log_var_error"] >= 0
        if r["task"] == "classification":
            assert 0 <= r["ece"] <= 1 and 0 <= r["accuracy"] <= 1
    md = (tmp_path / "RESULTS.md").read_text()
    assert "## wine" in md and "## diabetes" in md and "val-grid" in md
    assert "## Criteria" in md and "Wall time (the whole run)" in md
    pairs = result["criteria"]["pairs"]
    assert len(pairs) == 2 * 2 * 2  # data sets × M × posteriors
    assert {r["selection"] for r in rows if r["method"] == "SFR-like CP (random)"} == {
        "evidence"
    }
    assert len(result["criteria"]["common_delta"]["pairs"]) == 2 * 2 * 2
    full_delta = {
        (r["dataset"], r["seed"]): r["delta"]
        for r in rows
        if r["method"] == "FullLaplace"
    }
    common = [r for r in rows if r["method"].endswith("at full δ")]
    assert len(common) == 2 * 2 * 2 * 2  # data sets × M × posteriors × locations
    for r in common:
        assert r["delta"] == full_delta[(r["dataset"], r["seed"])]


def test_ella_and_valla_rows_exactly_when_laplace_torch_has_them() -> None:
    from laplace import baselaplace

    from benchmarks.real.methods import METHODS

    has = hasattr(baselaplace, "ELLA")
    assert ("ELLA" in METHODS) == has and ("VaLLA" in METHODS) == has
    assert {"GP-subset", "CP (optimised)", "LFL full-Λ (optimised)"} <= set(METHODS)
