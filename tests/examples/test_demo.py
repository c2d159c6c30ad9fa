"""The command-line demo and the Done-when criterion of issue 4."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from laplace_diffjac.__main__ import main
from laplace_diffjac.examples import run_demo


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_quick_cli_writes_png(tmp_path, task):
    out = tmp_path / "demo.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "laplace_diffjac",
            "--task",
            task,
            "--quick",
            "--no-progress",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "ContextPosterior" in proc.stdout and "FunctionalLaplace" in proc.stdout
    assert str(out) in proc.stdout
    assert out.stat().st_size > 1000


def test_main_parses_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--task", "nonsense"])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_done_when_regression():
    """M <= 5 % of N, 3 seeds: optimised beats random on objective, errors, NLL."""
    results = [run_demo("regression", seed=s, progress_bar=False) for s in range(3)]
    _check(results)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_done_when_classification():
    """Two moons with overlap and label noise; same criterion as for regression.

    ``FunctionalLaplace`` here is ``LocationFunctionalLaplace`` with the GGN's full
    ``C × C`` output Hessian (``output_hessian='full'``); with laplace-torch's
    diagonal one the error stays large for any locations (see the demo's
    ``FunctionalLaplace (diag Λ)`` rows), which is not what this criterion is about.
    """
    results = [run_demo("classification", seed=s, progress_bar=False) for s in range(3)]
    for r in results:  # the problem is not trivial: the data move the posterior
        assert r.row("ContextPosterior", f"random {r.settings.m}")["error"] > 0
    _check(results)


def _check(results):
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for r in results:
        assert r.settings.m <= 0.05 * r.settings.n
        assert r.objective["optimised"] < r.objective["random"]
    for method, needed in (("ContextPosterior", 0.5), ("FunctionalLaplace", 0.2)):
        m = results[0].settings.m
        rand = mean([r.row(method, f"random {m}")["error"] for r in results])
        opt = mean([r.row(method, f"optimised {m}")["error"] for r in results])
        assert opt <= (1 - needed) * rand, (method, rand, opt)
        nll_r = mean([r.row(method, f"random {m}")["nll"] for r in results])
        nll_o = mean([r.row(method, f"optimised {m}")["nll"] for r in results])
        assert nll_o <= nll_r + 1e-3, (method, nll_r, nll_o)
