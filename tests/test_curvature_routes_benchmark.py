"""``benchmarks/curvature/``'s scripts in their quick modes.

``curvature_routes.py``: every row of the three ResNets and of the two text
models (the zoo's GPT-2 + LoRA and BERT, dict-like batches), numbers or how the
method failed, the report written, ``DiffBackPackGGN``'s rows all run (the text
models' too), its diagonal equal to laplace-torch's ``CurvlinopsGGN`` one (the
same GGN, from its Jacobians) where that runs, and on the LoRA factors its
Kronecker factors' trace equal to ``CurvlinopsGGN``'s. ``profile_phases.py``:
every phase printed, the phases within the total.

No timing is asserted: quick-mode timings are single cold runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts import ROOT, run_script

SCRIPT = ROOT / "benchmarks/curvature/curvature_routes.py"
PROFILE = ROOT / "benchmarks/curvature/profile_phases.py"
TEXT_MODELS = ["gpt2-lora", "bert"]
MODELS = ["resnet-nobn", "resnet-bn", "resnet-nobn-c100", *TEXT_MODELS]
METHODS = ["DiffBackPackGGN", "KFACLinearOperator", "CurvlinopsGGN", "BackPackGGN"]


@pytest.mark.slow
def test_quick_curvature_routes_rows_report_and_agreement(tmp_path: Path) -> None:
    out = tmp_path / "curvature.json"
    run_script(
        SCRIPT, "--quick", "--threads", "1", "--out", str(out),
        "--max-jacobian-gib", "0.5",  # CurvlinopsGGN.diag's J: 10 classes only
    )  # fmt: skip
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert {(r["model"], r["method"]) for r in rows} == {
        (m, method) for m in MODELS for method in METHODS
    }
    for r in rows:  # a number or why not
        assert "seconds" in r or r.get("error") or r.get("skipped"), r
        if "error" in r:  # a failure is a result: its type and first line
            assert r["error"].split(":")[0].isidentifier(), r
        elif "skipped" not in r:
            assert r["seconds"] > 0 and r["peak_gib"] >= 0 and r["check"] > 0, r
    ours = [r for r in rows if r["method"] == "DiffBackPackGGN"]
    assert len(ours) == 4 * len(MODELS) and all("seconds" in r for r in ours), ours
    lora = [r for r in rows if r["model"] == "gpt2-lora"]
    assert {r["n_params_curvature"] for r in lora} == {128}, lora  # LoRA only
    assert all(r["n_params_curvature"] < r["n_params"] for r in lora)
    kfac = next(
        r
        for r in rows
        if (r["model"], r["method"], r["variant"])
        == ("resnet-nobn", "KFACLinearOperator", "type-2")
    )
    assert kfac["time_ratio"] == 1.0
    for model in MODELS:
        by = {(r["method"], r["variant"]): r for r in rows if r["model"] == model}
        theirs = by[("CurvlinopsGGN", "diag")]
        if "check" in theirs:
            mine = by[("DiffBackPackGGN", "diag")]["check"]
            assert abs(mine - theirs["check"]) <= 1e-4 * abs(theirs["check"])
    by = {(r["method"], r["variant"]): r for r in lora}
    if "check" in by[("CurvlinopsGGN", "kron")]:
        theirs = by[("CurvlinopsGGN", "kron")]["check"]
        mine = by[("DiffBackPackGGN", "kron")]["check"]
        assert abs(mine - theirs) <= 1e-4 * abs(theirs)
    report = (tmp_path / "CURVATURE_ROUTES.md").read_text()
    assert all(f"## {model}\n" in report for model in MODELS)


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_quick_profile_prints_every_phase(structure: str) -> None:
    stdout = run_script(PROFILE, "--quick", "--structure", structure, "--threads", "1")
    values = {
        name: float(value)
        for name, value, *_ in (line.split() for line in stdout.splitlines()[1:])
    }
    assert set(values) == {"forward", "backward", "rules", "sums", "total", "peak_gib"}
    assert all(values[p] > 0 for p in ("forward", "backward", "rules", "sums"))
    assert values["total"] >= values["backward"] + values["sums"]
