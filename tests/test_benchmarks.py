"""The benchmark harness runs in quick mode and every method is correct there.

No timing is asserted: quick-mode timings are single cold runs.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks/jacobians/run.py"
HARNESS = RUN.parent


def _run_benchmarks(*args: str) -> None:
    """``python benchmarks/jacobians/run.py ARGS`` from the repository root."""
    proc = subprocess.run(
        [sys.executable, str(RUN), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_quick_benchmark_runs_and_every_method_is_correct(tmp_path: Path) -> None:
    out, raw = tmp_path / "RESULTS.md", tmp_path / "results.json"
    _run_benchmarks("--quick", "--out", str(out), "--json", str(raw))
    results = json.loads(raw.read_text())
    jac = [r for r in results if r["task"] == "jacobian"]
    methods = {r["method"] for r in jac}
    assert methods == {
        "lt_BackPackGGN",
        "lt_jacrev_batch",
        "vmap_jacrev",
        "DiffFuncGGN",
        "DiffBackPackGGN",
    }
    assert {r["config"].split("-")[0][:3] for r in jac} == {"mlp", "cnn"}
    for r in results:
        assert r["ok"], r
        err = r["rel_err_J"] if r["task"] == "jacobian" else r["rel_err_K"]
        assert err < 1e-4, r
        if r["task"] == "jacobian":
            assert r["rel_err_grad_x"] < 1e-3, r
    assert {r["method"] for r in results if r["task"] == "gram"} >= {"J", "structured"}
    text = out.read_text()
    assert "### Headline" in text and "### Targets" in text
    assert "| config | allocator | P | obj. | lt_BackPackGGN |" in text
    assert {(r["allocator"], r["device"]) for r in results} == {("default", "cpu")}
    assert "| correct |" in text and "| NO |" not in text
    assert "laplace-torch" in text and "CPU:" in text

    again = tmp_path / "AGAIN.md"
    _run_benchmarks("--report-from", str(raw), "--out", str(again))
    rendered = again.read_text()
    assert "rendered again from its saved results" in rendered
    # same tables, apart from the header lines (command and date)
    assert rendered.split("### Targets")[1] == text.split("### Targets")[1]


def test_timings_of_several_processes_combine_by_their_median() -> None:
    merge_timings = _harness("run").merge_timings
    results = [
        {"config": "c", "task": "jacobian", "method": m, "ok": True} for m in ("a", "b")
    ]
    runs = [(1.0, 4.0, 2.0), (3.0, 5.0, 2.5), (2.0, 9.0, 1.0)]
    timings = [
        {"config": "c", "task": "timing", "method": "a", "ok": True, "reps": 5}
        | {"t_jac": j, "t_full": f, "t_obj": o}
        for j, f, o in runs
    ] + [
        {"config": "c", "task": "timing", "method": "b", "ok": True, "reps": 5},
        {"config": "c", "task": "timing", "method": "b", "ok": False, "error": "x"},
    ]
    merge_timings(results, timings)
    a, b = results
    assert (a["t_jac"], a["t_full"], a["t_obj"]) == (2.0, 5.0, 2.0)
    assert a["t_full_per_process"] == [4.0, 5.0, 9.0]
    assert a["reps"] == 15 and a["timing_processes"] == 3
    assert not b["ok"] and "x" in b["error"]


def _harness(module: str):
    """A module of the harness (``benchmarks/jacobians``), imported by name."""
    sys.path.insert(0, str(HARNESS))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(HARNESS))


def test_each_allocator_setting_reaches_its_worker_processes() -> None:
    """``thp`` through the environment the worker starts with, ``mmap-off`` inside
    it; a worker started in the wrong environment refuses to measure."""
    run, allocator = _harness("run"), _harness("allocator")
    specs, _ = run.build_specs(True, ["DiffBackPackGGN"], None, ["thp", "mmap-off"])
    assert [s["allocator"] for s in specs] == ["thp"] * 3 + ["mmap-off"] * 3
    assert {s["device"] for s in specs} == {"cpu"}
    base = {"THP_MEM_ALLOC_ENABLE": "1", "OTHER": "x"}
    assert allocator.process_environment("default", base) == {"OTHER": "x"}
    assert allocator.process_environment("mmap-off", base) == {"OTHER": "x"}
    assert allocator.process_environment("thp", {})["THP_MEM_ALLOC_ENABLE"] == "1"
    with pytest.raises(ValueError, match="one of"):
        allocator.process_environment("jemalloc")
    gram = [s for s in specs if s["task"] == "gram"]
    for spec in gram:
        (result,) = run.run_worker({**spec, "methods": ["structured"]}, 300)
        assert result["ok"], result
        assert result["allocator"] == spec["allocator"]
        assert result["rel_err_K"] < 1e-4
    wrong = {**gram[0], "methods": ["structured"]}
    proc = subprocess.run(
        [sys.executable, str(HARNESS / "worker.py"), json.dumps(wrong)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"},
    )
    assert proc.returncode != 0 and "THP_MEM_ALLOC_ENABLE=1" in proc.stderr
