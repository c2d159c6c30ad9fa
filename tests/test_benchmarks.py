"""The benchmark harness runs in quick mode and every method is correct there.

No timing is asserted: quick-mode timings are single cold runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_benchmark_runs_and_every_method_is_correct(tmp_path: Path) -> None:
    out, raw = tmp_path / "RESULTS.md", tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick"]
        + ["--out", str(out), "--json", str(raw)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
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
    assert "| config | P | obj. | lt_BackPackGGN |" in text
    assert "| correct |" in text and "| NO |" not in text
    assert "laplace-torch" in text and "CPU:" in text

    again = tmp_path / "AGAIN.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py")]
        + ["--report-from", str(raw), "--out", str(again)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rendered = again.read_text()
    assert "rendered again from its saved results" in rendered
    # same tables, apart from the header lines (command and date)
    assert rendered.split("### Targets")[1] == text.split("### Targets")[1]
