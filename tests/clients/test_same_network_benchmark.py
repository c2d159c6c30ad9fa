"""benchmarks/bayesopt/same_network.py runs in quick mode and reports every surrogate.

No timing or value is asserted beyond sanity: each surrogate is measured on the
one network, with finite predictive log likelihoods and a pick inside the cube.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.scripts import ROOT, run_script

pytest.importorskip("laplace_bayesopt")
pytest.importorskip("botorch")

SURROGATES = 7


@pytest.mark.slow
def test_quick_same_network_benchmark_reports_every_surrogate(tmp_path: Path) -> None:
    script = ROOT / "benchmarks/bayesopt/same_network.py"
    run_script(script, "--quick", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "same_network.json").read_text())["rows"]
    assert len({r["surrogate"] for r in rows}) == SURROGATES == len(rows)
    for r in rows:
        assert math.isfinite(r["nll"]) and math.isfinite(r["pick_value"])
        assert r["sd_inside"] > 0 and r["sd_corners"] > 0
        assert r["pick_improves"] == (r["pick_gain_sd"] > 0)
        assert 0 <= r["pick_on_faces"] <= 1
    text = (tmp_path / "SAME_NETWORK.md").read_text()
    assert text.count("| branin |") == SURROGATES


@pytest.mark.slow
def test_same_network_without_optimised_locations_in_two_workers(
    tmp_path: Path,
) -> None:
    script = ROOT / "benchmarks/bayesopt/same_network.py"
    args = ["--quick", "--no-optimised", "--workers", "2", "--functions"]
    args += ["six_hump_camel", "--seeds", "0", "1", "--out", str(tmp_path)]
    run_script(script, *args)
    rows = json.loads((tmp_path / "same_network.json").read_text())["rows"]
    # No optimised locations: the reference and four exact posteriors, per seed.
    assert len(rows) == 2 * (SURROGATES - 2)
    assert {r["seed"] for r in rows} == {0, 1}
    assert not any(r["surrogate"].startswith("optimised") for r in rows)
