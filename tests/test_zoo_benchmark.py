"""``benchmarks/zoo/zoo_flavours.py`` in its quick mode: every model of the zoo, one
flavour each, every backend, a row for each (numbers or how the backend failed), the
report written, and this package's backends agreeing with laplace-torch's default
where the curvature is defined alike.

No timing is asserted: quick-mode timings are single cold runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/zoo/zoo_flavours.py"
MODELS = ["gpt2", "bert", "vit", "gpt2-lora", "resnet", "mobilenet"]
BACKENDS = ["default", "BackPackGGN", "DiffBackPackGGN", "DiffFuncGGN"]


def _run(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, SCRIPT, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_quick_zoo_flavours_rows_report_and_agreement(tmp_path: Path) -> None:
    out = tmp_path / "zoo.json"
    _run("--quick", "--out", str(out))
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert [(r["model"], r["backend"]) for r in rows] == [
        (m, b) for m in MODELS for b in BACKENDS
    ]
    for r in rows:
        if "error" in r:  # a failure is a result: its stage and first line
            assert r["stage"] and r["error"].split(":")[0].isidentifier(), r
        else:
            assert r["fit_s"] > 0 and r["predict_s"] > 0 and r["peak_gib"] >= 0, r
    ours = [r for r in rows if r["backend"] == "DiffBackPackGGN"]
    assert all("error" not in r for r in ours), ours
    # Where laplace-torch's default fits the same curvature (the GGN diagonal, KFAC
    # of LoRA's Linear layers), ours equal it to float32's precision.
    for r in rows:
        same = r["model"] in ("gpt2-lora", "resnet", "mobilenet")
        if same and r["backend"] in ("DiffBackPackGGN", "DiffFuncGGN"):
            assert r["curvature_rel_diff_vs_default"] < 1e-4, r
            assert r["probs_abs_diff_vs_default"] < 1e-4, r
    assert results["environment"]["threads"] == 2

    report = (tmp_path / "ZOO.md").read_text()
    assert f"`python {SCRIPT} --quick --out {out}`" in report
    for title in ("## GPT-2", "## BERT", "## ViT", "## GPT-2 + LoRA", "## ResNet"):
        assert title in report
    assert report.count("| laplace-torch's default |") == len(MODELS)
    assert "fails in" in report  # laplace-torch's BackPackGGN refuses dict batches

    (tmp_path / "ZOO.md").unlink()
    _run("--report-only", "--out", str(out))
    assert (tmp_path / "ZOO.md").read_text() == report
