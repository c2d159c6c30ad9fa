"""benchmarks/bayesopt/bayesopt.py runs in quick mode with every method, and reports.

No timing is asserted. Every method must run the same initial design, record a
regret curve that never increases (it is the best value so far), one fit or
update per iteration plus the initial fit, and appear in the report.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.scripts import ROOT, load_script, run_script

pytest.importorskip("laplace_bayesopt")
pytest.importorskip("botorch")

SCRIPT = ROOT / "benchmarks/bayesopt/bayesopt.py"


def _methods() -> int:
    """How many methods the script lists (its ``METHODS`` tuple, read, not run)."""
    tree = ast.parse(SCRIPT.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "METHODS" for t in node.targets
        ):
            return len(ast.literal_eval(node.value))
    raise AssertionError("bayesopt.py has no METHODS tuple")


METHODS = _methods()


def _script():
    """The script as a module."""
    return load_script(SCRIPT, "bayesopt_benchmark")


def test_posterior_calls_are_counted_and_the_model_left_as_it_was() -> None:
    from botorch.models import SingleTaskGP

    counted_posterior = _script()._counted_posterior
    X = torch.rand(6, 2, dtype=torch.float64)
    model = SingleTaskGP(X, X.sum(-1, keepdim=True))
    with counted_posterior(model) as counts:
        with torch.no_grad():
            model.posterior(torch.rand(4, 3, 2, dtype=torch.float64))
        model.posterior(X=torch.rand(5, 2, dtype=torch.float64))
    assert (counts.calls, counts.points, counts.scoring_calls) == (2, 17, 1)
    assert "posterior" not in vars(model)
    with pytest.raises(RuntimeError, match="inside"), counted_posterior(model):
        raise RuntimeError("inside the block")
    assert "posterior" not in vars(model)


def test_method_flags_are_parsed_and_unknown_ones_refused() -> None:
    flags = _script()._flags
    assert flags("ContextBoTorch", "ContextBoTorch", ("factors",)) == []
    assert flags(
        "ContextBoTorch(factors,noise)", "ContextBoTorch", ("factors", "noise")
    ) == [
        "factors",
        "noise",
    ]
    with pytest.raises(ValueError, match="unknown flags"):
        flags("Context(random,fast)", "Context", ("random",))
    with pytest.raises(ValueError, match="is not Context"):
        flags("Context[random]", "Context", ("random",))


def test_on_faces_counts_coordinates_on_the_cube_faces() -> None:
    on_faces = _script().on_faces
    points = torch.tensor([[0.0, 0.5, 1.0, 0.2], [1.0, 1.0, 0.3, 1e-12]])
    assert on_faces(points) == 5 / 8
    assert on_faces(torch.full((3, 2), 0.5)) == 0.0


def test_maxiter_caps_every_restart_of_the_acquisition() -> None:
    from botorch.models import SingleTaskGP

    script = _script()
    torch.manual_seed(0)
    X = torch.rand(30, 6, dtype=torch.float64)
    model = SingleTaskGP(X, torch.sin(6 * X).sum(-1, keepdim=True))
    capped = script.replace(script.QUICK, q=1, restarts=2, raw_samples=8, maxiter=1)
    free = script.replace(capped, maxiter=0)
    best = model.train_targets.max()
    _, calls_capped = script._acquire(model, best, 6, capped)
    _, calls_free = script._acquire(model, best, 6, free)
    # One L-BFGS-B iteration takes at most 1 + maxls = 21 evaluations; without
    # the cap the restarts run on (13 to 24 evaluations for seeds 0 to 3).
    gradient_calls = calls_capped.calls - calls_capped.scoring_calls
    assert 0 < gradient_calls <= 21
    assert gradient_calls < calls_free.calls - calls_free.scoring_calls


@pytest.mark.slow
def test_quick_bayesopt_benchmark_runs_every_method(tmp_path: Path) -> None:
    assert METHODS >= 3
    run_script(SCRIPT, "--quick", "--workers", "1", "--out", str(tmp_path), timeout=900)
    raw = [json.loads(p.read_text()) for p in (tmp_path / "raw").glob("*.json")]
    assert len({r["method"] for r in raw}) == METHODS
    first_best = {r["best"][0] for r in raw}
    assert len(first_best) == 1  # the same initial design for every method
    for r in raw:
        assert len(r["regret"]) == 4 and len(r["fit_s"]) == 4 and len(r["acq_s"]) == 3
        # Every acquisition called the posterior: the raw samples' scores (no
        # gradient) and at least one optimiser step (with one).
        assert len(r["acq_calls"]) == 3
        for counts in r["acq_calls"]:
            assert 0 < counts["scoring_calls"] < counts["calls"] <= counts["points"]
        assert len(r["acq_on_faces"]) == 3
        assert all(0 <= share <= 1 for share in r["acq_on_faces"])
        assert all(a >= b >= 0 for a, b in zip(r["regret"], r["regret"][1:]))
    report = json.loads((tmp_path / "bayesopt.json").read_text())
    assert len(report["table"]["branin"]) == METHODS
    assert {row["method"] for row in report["criterion"]} == {
        r["method"] for r in raw if r["method"].startswith("Context")
    }
    text = (tmp_path / "BAYESOPT.md").read_text()
    lines = text.splitlines()
    # Every method twice (regrets, improving iterations), and the headline; then
    # every method's acquisition counts.
    assert sum(line.startswith("| branin |") for line in lines) == 2 * METHODS + 1
    assert (
        sum(
            line.endswith("|")
            and "| branin | " in line
            and not line.startswith("| branin |")
            for line in lines
        )
        == METHODS
    )
    assert "## Headline" in text
    assert (tmp_path / "regret.png").stat().st_size > 0
    assert (tmp_path / "regret_branin.png").stat().st_size > 0


def test_caller_standardised_outcomes_leave_the_regret_in_the_function_units() -> None:
    """``--outcomes caller`` (issue #44's protocol): the surrogate sees the initial
    design's standardisation and no outcome transform; the regret stays raw."""
    script = _script()
    cfg = script.replace(script.QUICK, outcomes="caller", iterations=2)
    assert script._outcome_transform(cfg) == {}
    assert set(script._outcome_transform(script.QUICK)) == {"outcome_transform"}
    record = script.run_task("six_hump_camel", "ContextBoTorch", 0, cfg)
    problem = script._problem("six_hump_camel")
    _, Y, _ = script.initial_design(problem, cfg.initial, 0)
    assert record["regret"][0] == pytest.approx(float(problem.optimal_value - Y.max()))
    assert len(record["regret"]) == 3
    assert all(a >= b >= 0 for a, b in zip(record["regret"], record["regret"][1:]))


def test_every_function_the_script_names_is_a_botorch_problem() -> None:
    script = _script()
    names = script.ALL_FUNCTIONS
    assert len(set(names)) == len(names) == 20
    tuning, held_out = script.TUNING_FUNCTIONS, script.HELD_OUT_FUNCTIONS
    assert len(tuning) == len(held_out) == 10 and not set(tuning) & set(held_out)
    assert set(script.FUNCTIONS + script.STALL_FUNCTIONS) == set(tuning)
    dims = {script.problem_dim(name) for name in names}
    assert min(dims) == 2 and max(dims) == 20
    gen = torch.Generator().manual_seed(0)
    for name in names:
        problem = script._problem(name)
        assert problem.bounds.shape == (2, problem.dim)
        assert problem.optimal_value is not None
        # maximised in the unit cube: no point beats the optimum
        x = torch.rand(256, problem.dim, generator=gen, dtype=torch.float64)
        values = script._objective(problem)(x)
        assert (values <= problem.optimal_value + 1e-9).all(), name


def _record(function: str, method: str, seed: int, regret: list, **more) -> dict:
    return {"function": function, "method": method, "seed": seed, "q": 1,
            "regret": regret, "cpu_s": 1.0, "acq_on_faces": [0.5], **more}  # fmt: skip


def test_the_halves_report_applies_the_issues_criterion_per_function(
    tmp_path: Path,
) -> None:
    halves = load_script(ROOT / "benchmarks/bayesopt/halves.py", "bo_halves")
    laplace = [_record("beale", "LaplaceBoTorch", s, [10.0, 1.0]) for s in (0, 1)]
    ours = [
        _record("beale", "ContextBoTorch", 0, [10.0, 1.1], cpu_s=0.1),
        _record("beale", "ContextBoTorch", 1, [10.0, 1.1], cpu_s=0.3),
    ]
    rows = halves.compare([*laplace, *ours], ("beale", "bukin"))
    beale, bukin = rows
    assert "ours" not in bukin and bukin["dim"] == 2
    # log10(1.1) = 0.041 above: within 0.05; time 0.2 of Laplace's, shares equal
    assert beale["ours"]["log10"] == pytest.approx(0.0414, abs=1e-4)
    assert beale["time_ratio"] == pytest.approx(0.2) and beale["met"]
    assert beale["paired"][2] == 2
    slower = [dict(r, cpu_s=0.5) for r in ours]
    assert not halves.compare([*laplace, *slower], ("beale",))[0]["met"]
    worse = [dict(r, regret=[10.0, 1.2]) for r in ours]  # log10 1.2 = 0.079
    assert not halves.compare([*laplace, *worse], ("beale",))[0]["met"]
    faces = [dict(r, acq_on_faces=[0.6]) for r in ours]
    assert not halves.compare([*laplace, *faces], ("beale",))[0]["met"]
    stalled = [dict(r, regret=[10.0, 10.0, 1.1]) for r in ours]  # improves 1 of 2
    assert not halves.compare([*laplace, *stalled], ("beale",))[0]["met"]
    text = "\n".join(halves.table_lines("held-out half, q = 1", rows))
    assert "| bukin | 2 | not run |" in text
    assert "Criterion met on 1 of the 1 functions run." in text
    # the command line, on records in a run's raw/ folder
    (tmp_path / "run" / "raw").mkdir(parents=True)
    for r in [*laplace, *ours]:
        name = f"{r['function']}_{r['method']}_{r['seed']}.json"
        (tmp_path / "run" / "raw" / name).write_text(json.dumps(r))
    out = tmp_path / "HALVES.md"
    halves.main(["--q1", str(tmp_path / "run"), "--out", str(out)])
    written = out.read_text()
    assert "### held-out half, q = 1" in written and "| beale | 2 |" in written
    assert "### tuning half, q = 1" in written and "q = 4" not in written
    rows = json.loads((tmp_path / "halves.json").read_text())["q1 held-out half"]
    assert [r["function"] for r in rows] == list(halves.bayesopt.HELD_OUT_FUNCTIONS)


def test_the_halves_report_compares_an_ablation_with_ours(tmp_path: Path) -> None:
    """``--ours METHOD`` puts another method against LaplaceBoTorch; the
    ContextBoTorch records beside it are ignored."""
    halves = load_script(ROOT / "benchmarks/bayesopt/halves.py", "bo_halves")
    laplace = [_record("beale", "LaplaceBoTorch", s, [10.0, 1.0]) for s in (0, 1)]
    context = [_record("beale", "ContextBoTorch", s, [10.0, 5.0]) for s in (0, 1)]
    ablation = "ContextBoTorch(kron-covariance)"
    variant = [_record("beale", ablation, s, [10.0, 1.0], cpu_s=0.1) for s in (0, 1)]
    (row,) = halves.compare([*laplace, *context, *variant], ("beale",), ablation)
    assert row["ours"]["log10"] == pytest.approx(0.0) and row["met"]
    (default,) = halves.compare([*laplace, *context, *variant], ("beale",))
    assert default["ours"]["log10"] == pytest.approx(0.699, abs=1e-3)
    (tmp_path / "run" / "raw").mkdir(parents=True)
    for r in [*laplace, *context, *variant]:
        name = f"{r['function']}_{r['method']}_{r['seed']}.json"
        (tmp_path / "run" / "raw" / name).write_text(json.dumps(r))
    out = tmp_path / "ABLATION.md"
    halves.main(["--q1", str(tmp_path / "run"), "--out", str(out), "--ours", ablation])
    text = out.read_text()
    assert text.startswith(f"# {ablation} against LaplaceBoTorch")
    assert f"--ours '{ablation}'" in text
    rows = json.loads((tmp_path / "ablation.json").read_text())["q1 held-out half"]
    assert rows[[r["function"] for r in rows].index("beale")]["met"]


def test_the_halves_report_takes_laplace_from_the_recorded_run(tmp_path: Path) -> None:
    """``--laplace DIR``: a rerun of ContextBoTorch alone against the recorded
    LaplaceBoTorch; the recorded run's own ContextBoTorch is not read."""
    halves = load_script(ROOT / "benchmarks/bayesopt/halves.py", "bo_halves")
    recorded = [_record("beale", "LaplaceBoTorch", s, [10.0, 1.0]) for s in (0, 1)]
    recorded += [_record("beale", "ContextBoTorch", s, [10.0, 5.0]) for s in (0, 1)]
    rerun = [
        _record("beale", "ContextBoTorch", s, [10.0, 1.0], cpu_s=0.1) for s in (0, 1)
    ]
    for folder, records in (("recorded", recorded), ("rerun", rerun)):
        (tmp_path / folder / "raw").mkdir(parents=True)
        for r in records:
            name = f"{r['function']}_{r['method']}_{r['seed']}.json"
            (tmp_path / folder / "raw" / name).write_text(json.dumps(r))
    out = tmp_path / "AFTER.md"
    rerun_dir, recorded_dir = str(tmp_path / "rerun"), str(tmp_path / "recorded")
    halves.main(["--q1", rerun_dir, "--laplace", recorded_dir, "--out", str(out)])
    rows = json.loads((tmp_path / "after.json").read_text())["q1 held-out half"]
    beale = rows[[r["function"] for r in rows].index("beale")]
    assert beale["ours"]["log10"] == pytest.approx(0.0)  # the rerun's, not 0.699
    assert beale["ref"]["seeds"] == [0, 1] and beale["met"]
    assert "LaplaceBoTorch's from: `recorded/`" in out.read_text()


def test_the_kron_covariance_ablation_is_the_kfac_posterior_of_its_network() -> None:
    """``ContextBoTorch(kron-covariance)``: the joint covariance of a q-batch is
    ``J Σ Jᵀ`` of laplace-torch's ``KronLaplace`` on the same network, data,
    ``δ`` and ``σ`` (fitted here independently, with laplace-torch's own
    ``BackPackGGN``, and its Jacobians from a float64 per-sample autograd loop),
    and the mean is ContextBoTorch's."""
    import warnings

    from laplace import Laplace
    from laplace.curvature import BackPackGGN
    from torch.utils.data import DataLoader, TensorDataset

    from tests.references import reference_jacobians

    script = _script()
    cfg = script.replace(script.QUICK, outcomes="caller")
    problem = script._problem("branin")
    X, Y, _ = script.initial_design(problem, 8, 0)
    model = script._surrogate("ContextBoTorch(kron-covariance)", X, Y, cfg, 0).model
    Xq = torch.rand(3, 2, 2, generator=torch.Generator().manual_seed(1)).double()
    got = model.posterior(Xq)
    post = model.context_posterior
    # before laplace-torch's BackPACK extends the network (its hooks stay on it)
    J, _ = reference_jacobians(post.model, Xq.reshape(-1, 2), loop=True)  # (6, 1, P)
    laplace = Laplace(
        post.model, "regression", subset_of_weights="all", hessian_structure="kron",
        backend=BackPackGGN,
        prior_precision=float(post.prior_precision.reshape(-1)[0]),
        sigma_noise=float(post.sigma_noise.reshape(-1)[0]),
    )  # fmt: skip
    with warnings.catch_warnings():  # BackPACK's full backward hooks warn
        warnings.simplefilter("ignore", UserWarning)
        laplace.fit(
            DataLoader(TensorDataset(model.train_X, model.train_Y), batch_size=10)
        )
    want = laplace.posterior_precision.inv_square_form(J.reshape(3, 2, -1))
    torch.testing.assert_close(got.covariance_matrix, want, rtol=1e-8, atol=1e-10)
    mean, exact = post.joint_predictive(Xq)  # ContextBoTorch's own predictive
    torch.testing.assert_close(got.mean, mean)  # (3, 2, 1)
    assert not torch.allclose(got.covariance_matrix, exact)


def test_paired_log10_difference_is_taken_over_the_seeds_both_ran() -> None:
    report = load_script(ROOT / "benchmarks/bayesopt/bayesopt_report.py", "bo_report")

    def record(method: str, seed: int, final: float) -> dict:
        return {"function": "f", "method": method, "seed": seed,
                "regret": [2 * final, final], "fit_s": [1.0, 1.0],
                "acq_s": [1.0]}  # fmt: skip

    records = [
        record("ContextBoTorch", 0, 10.0),
        record("ContextBoTorch", 1, 100.0),
        record("ContextBoTorch", 2, 1e-3),  # no reference run for seed 2
        record("LaplaceBoTorch", 0, 1.0),
        record("LaplaceBoTorch", 1, 1.0),
        record("LaplaceBoTorch", 3, 0.0),  # found the optimum: floored
    ]
    table = report.aggregate(records)["f"]
    mean, se, n = report.paired_log10_difference(
        table["ContextBoTorch"], table["LaplaceBoTorch"]
    )
    # Seeds 0 and 1: differences 1 and 2 decades.
    assert (mean, se, n) == (pytest.approx(1.5), pytest.approx(0.5), 2)
    assert table["LaplaceBoTorch"]["final_log10_regret_mean"] == pytest.approx(-4.0)
    text = report.markdown(report.aggregate(records), [], {})
    assert "+1.50 ± 0.50 (2)" in text
    # One iteration per record, each lowering the regret (2·final to final):
    # all early, none after.
    assert table["ContextBoTorch"]["improving_early"] == 1.0
    assert table["ContextBoTorch"]["improving_late"] is None
    assert "| f | ContextBoTorch | 100 % | – |" in text


def test_improving_iterations_are_split_at_the_first_retraining() -> None:
    report = load_script(ROOT / "benchmarks/bayesopt/bayesopt_report.py", "bo_report")
    assert report.EARLY_ITERATIONS == 10
    regret = [5.0, 4.0, 4.0, 3.0, 3, 3, 3, 3, 3, 3, 3, 2.0, 2.0]
    record = {"function": "f", "method": "m", "seed": 0, "regret": regret,
              "fit_s": [1.0] * 13, "acq_s": [1.0] * 12}  # fmt: skip
    a = report.aggregate([record])["f"]["m"]
    # Iterations 1 and 3 of the first ten improved, then 11 of 11 and 12.
    assert a["improving_early"] == pytest.approx(0.2)
    assert a["improving_late"] == pytest.approx(0.5)


def test_the_halves_report_names_the_settings_an_ablation_changed(
    tmp_path: Path,
) -> None:
    """A folder whose run left a surrogate default (``--retrain-every 1``) is
    named with it in the report's header; the protocol's sizes and a folder at
    the defaults are not."""
    halves = load_script(ROOT / "benchmarks/bayesopt/halves.py", "bo_halves")
    defaults = dataclasses.asdict(halves.bayesopt.Config())
    protocol = {**defaults, "initial": 8, "iterations": 24, "outcomes": "caller"}
    for folder, config in (
        ("ablation", {**protocol, "retrain_every": 1}),
        ("recorded", protocol),
    ):
        (tmp_path / folder / "raw").mkdir(parents=True)
        runs = {"runs": [{"command": "bayesopt.py", "config": config}]}
        (tmp_path / folder / "run.json").write_text(json.dumps(runs))
    assert halves.changed_settings(tmp_path / "ablation") == {"retrain_every": 1}
    assert halves.changed_settings(tmp_path / "recorded") == {}
    assert halves.changed_settings(tmp_path) == {}  # no run.json
    records = [_record("beale", "LaplaceBoTorch", s, [10.0, 1.0]) for s in (0, 1)]
    records += [_record("beale", "ContextBoTorch", s, [10.0, 1.0]) for s in (0, 1)]
    for r in records:
        name = f"{r['function']}_{r['method']}_{r['seed']}.json"
        (tmp_path / "ablation" / "raw" / name).write_text(json.dumps(r))
    out = tmp_path / "ABLATION.md"
    halves.main(
        ["--q1", str(tmp_path / "ablation"), str(tmp_path / "recorded"),
         "--out", str(out)]
    )  # fmt: skip
    header = out.read_text().split("###")[0]
    assert "`ablation/` `--retrain-every 1`" in header
    assert "recorded/` `--" not in header and "--initial" not in header


@pytest.mark.parametrize(
    ("methods", "imported"),
    [
        (("SingleTaskGP",), set()),
        (("LaplaceBoTorch",), {"laplace_bayesopt.botorch"}),
        (("ContextBoTorch",), {"laplace_diffjac.bayesopt"}),
    ],
)
def test_a_worker_imports_what_its_methods_need_before_any_task(methods, imported):
    """The imports (about 4 s for laplace-torch) are not charged to a task's clock."""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks/bayesopt'); import bayesopt; "
        f"bayesopt.import_surrogates({methods!r}); "
        "print(sorted(m for m in ('laplace_bayesopt.botorch', "
        "'laplace_diffjac.bayesopt') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(ast.literal_eval(proc.stdout.strip())) == imported
