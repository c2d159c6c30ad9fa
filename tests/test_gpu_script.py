"""``benchmarks/gpu/run_on_gpu.py``: its dry run on the CPU runs every step of a GPU
run at smoke sizes and writes what a GPU run writes; a step that overruns its limit
or the budget is cut off and recorded, and the next step still runs.

The dry run's ``ntk_budget``, ``context:step``, ``context:large`` and ``ntk`` steps
are the quick modes of ``benchmarks/jacobians/ntk_budget.py``,
``benchmarks/context_posterior/context_budget.py`` and ``ntk_routes.py``, so this
test checks those scripts' rows too rather than running them a second time:
every budget row in its own process, the small budgets chunk (a step too large
for its budget is refused), and every row's Gram and gradient, posterior or
locations equal the unbudgeted row's; every NTK route runs or says why not,
agrees with the per-layer factor route, each allocator setting has its run,
FLOPs stand beside the times, and the Markdown report renders again from the
JSON.

No timing is asserted: the dry run's timings are single cold runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script, run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/gpu/run_on_gpu.py"


def _script():
    """The script as a module."""
    return load_script(SCRIPT, "run_on_gpu")


@pytest.mark.slow
def test_the_dry_run_on_the_cpu_runs_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--device", "cpu", "--quick"]
        + ["--no-install"],
        cwd=tmp_path,  # the script finds the repository itself
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((out / "gpu_run.json").read_text())
    steps = {s["name"]: s for s in record["steps"]}
    context = ["context:fit", "context:step", "context:large"]
    assert list(steps) == [
        "environment", "tests", "ntk_budget", *context,
        "ntk", "route_costs", "jacobians",
    ]  # fmt: skip
    assert all(s["ok"] for s in steps.values()), record
    assert sum(s["seconds"] for s in steps.values()) < record["budget_s"] == 450
    tests = steps["tests"]["notes"]
    assert tests["tests"] >= 10 and tests["failures"] == tests["errors"] == 0
    results = json.loads((out / "results.json").read_text())
    assert {r["device"] for r in results} == {"cpu"} and all(r["ok"] for r in results)
    assert {r["task"] for r in results} == {"jacobian", "gram"}
    _check_ntk_routes(out / "ntk_routes.json", out / "NTK_ROUTES.md", tmp_path)
    text = (out / "GPU.md").read_text()
    assert "| tests | ok |" in text and "| ntk | ok |" in text
    assert "| config | allocator | P | obj. |" in text
    assert "| model | B | allocator | route |" in text
    _check_ntk_budget_rows(out / "ntk_budget.json", text)
    fit = json.loads((out / "context_fit.json").read_text())
    assert fit["meta"]["device"] == "cpu" and fit["meta"]["reference"] == "default"
    assert [(r["dtype"], r["budget"]) for r in fit["rows"]] == [
        ("float64", "default"), ("float32", "default")
    ]  # fmt: skip
    assert all("fit_s" in r for r in fit["rows"]), fit["rows"]
    # float32's error against float64, measured, not zero and not large
    assert 0 < fit["rows"][1]["rel_diff"] < 1e-3
    _check_small_budget_rows(out / "context_large.json", out / "context_step.json")
    assert "| M | N | budget | dtype | plan |" in text
    assert "| M | N | minibatch | budget | plan |" in text
    logs = ("logs/tests.log", "logs/ntk_budget.log", "logs/context-fit.log")
    for name in ("RESULTS.md", "NTK_ROUTES.md", "NTK_BUDGET.md", "tests.xml", *logs):
        assert (out / name).exists(), name


def test_a_step_past_its_limit_is_cut_off_and_the_budget_holds(tmp_path, monkeypatch):
    script = _script()
    monkeypatch.setitem(script.LIMITS, "tests", 6)
    runner = script.Runner(tmp_path, budget_s=20)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    slow = runner.run("tests", sleep)
    assert slow.timed_out and not slow.ok and 5 < slow.seconds < 30
    runner.deadline = 0.0  # the budget is spent: later steps are skipped
    skipped = runner.run("ntk", [sys.executable, "-c", "pass"])
    assert skipped.returncode is None and "no time left" in skipped.notes["skipped"]
    done = script.summary(runner, "cpu", True, 20)
    assert "| tests | timed out |" in done and "| ntk | skipped |" in done


def test_junit_counts_are_read(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite tests="7" failures="1" errors="0" skipped="2">'
        "</testsuite></testsuites>"
    )
    counts = _script().test_counts(xml)
    assert counts == {"tests": 7, "failures": 1, "errors": 0, "skipped": 2}
    assert _script().test_counts(tmp_path / "missing.xml") == {}


def test_a_failed_test_step_reads_failed_whatever_pytest_skipped(tmp_path):
    """A test step that fails, with pytest's counts (a ``skipped`` among them) in
    its notes, reads "failed" in GPU.md, not "skipped"; a step never started reads
    "skipped"."""
    script = _script()
    runner = script.Runner(tmp_path, budget_s=60)
    failed = runner.run("tests", [sys.executable, "-c", "raise SystemExit(1)"])
    failed.notes.update({"tests": 20, "failures": 1, "errors": 0, "skipped": 0})
    runner.deadline = 0.0
    runner.run("ntk", [sys.executable, "-c", "pass"])
    done = script.summary(runner, "cpu", True, 60)
    assert "| tests | failed |" in done and "| ntk | skipped |" in done


def _check_small_budget_rows(fit_path: Path, step_path: Path) -> None:
    """``context_budget.py --quick`` under no budget and two small ones (the dry
    run's ``context:large`` and ``context:step``): every row in its own process,
    small budgets chunk the fit (recomputing or holding the locations) and the
    location step, a budget too small for a step is refused, and every row's
    predictive variance and evidence, or locations after three steps, equal the
    unbudgeted row's."""
    budgets = ["none", "640 KiB", "2.25 MiB"]
    fit = json.loads(fit_path.read_text())
    fits = fit["rows"]
    assert [(r["path"], r["budget"]) for r in fits] == [("fit", b) for b in budgets]
    for row in fits:
        assert "error" not in row, row
        assert row["fit_s"] > 0 and row["rel_diff"] < 1e-10
        assert row["fit_gflop"] > 0  # counted on one more, untimed fit
    assert fits[0]["plan"] == "whole"
    assert fits[1]["plan"].endswith("(recomputed)"), fits[1]
    assert fits[2]["plan"].endswith("(held)"), fits[2]
    assert fit["floor"]["flops_per_s"] > 0
    steps = json.loads(step_path.read_text())["rows"]
    assert [(r["path"], r["budget"]) for r in steps] == [("step", b) for b in budgets]
    assert steps[1]["error"].startswith("MemoryBudgetError: A location step")
    for row in (steps[0], steps[2]):
        assert "error" not in row, row
        # the model is float32, and so are the locations' gradients: the blocked
        # backward pass adds them in another order (float64 steps: test_budgeted_step)
        assert row["step_s"] > 0 and row["rel_diff"] < 1e-5
        assert row["total_gflop"] > 0
    assert steps[0]["plan"] == "whole"
    assert steps[2]["plan"].startswith("locations in blocks of"), steps[2]


def _check_ntk_budget_rows(path: Path, summary: str) -> None:
    """``ntk_budget.py --quick``: both routes under the default budget, a small
    one that chunks, and none; each agrees with the unbudgeted row."""
    budgeted = json.loads(path.read_text())
    assert budgeted["meta"]["device"] == "cpu"
    rows = budgeted["rows"]
    assert [(r["route"], r["budget"]) for r in rows] == [
        (route, budget)
        for route, small in (("factors", "320 KiB"), ("jacobians", "960 KiB"))
        for budget in ("default", small, "none")
    ]
    for row in rows:
        assert "error" not in row, row
        assert row["seconds"] > 0 and row["rel_diff"] < 1e-5  # float32 model
        assert row["gflop"] > 0
    assert "| B | route | budget | s | peak GiB |" in summary


def _check_ntk_routes(path: Path, report: Path, tmp_path: Path) -> None:
    """``ntk_routes.py --quick`` with two allocator settings."""
    results = json.loads(path.read_text())
    assert [run["allocator"] for run in results["runs"]] == ["default", "mmap-off"]
    for run in results["runs"]:
        assert run["device"] == "cpu" and run["matmul_gflop_per_s"] > 0
        assert set(run["cases"]) == {"mlp", "cnn", "transformer"}
        for case in run["cases"].values():
            rows = case["routes"]
            # the routes this package owns never fail
            factors, jacobians = rows["factors"], rows["jacobians"]
            assert "seconds" in factors and "seconds" in jacobians
            assert rows["default"]["took"] in ("factors", "jacobians")
            # forming J is more work, counted and by the cost model
            assert jacobians["gflop"] > factors["gflop"] > 0
            assert jacobians["model_gmac"] > factors["model_gmac"] > 0
            for row in rows.values():
                if "error" in row:
                    continue
                assert row["seconds"] > 0 and row["gflop_per_s"] > 0
                assert row["max relative difference to factors"] < 1e-4
    text = report.read_text()
    assert "| model | B | allocator | route | seconds | × factors | GFLOP |" in text
    assert "### Issue #28's targets, allocator `mmap-off`" in text
    assert "### Issue #42's route choice, allocator `mmap-off`" in text
    again = tmp_path / "AGAIN.md"
    script = ROOT / "benchmarks/jacobians/ntk_routes.py"
    run_script(script, "--report-from", str(path), "--markdown", str(again))
    assert again.read_text() == text
