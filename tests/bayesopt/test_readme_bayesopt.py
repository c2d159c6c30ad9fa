"""The Bayesian-optimisation page's loop runs as written, without warnings."""

from __future__ import annotations

import pytest
import torch

from tests.docs import block, page

pytest.importorskip("botorch")


@pytest.mark.slow
def test_readme_bayesopt_loop_runs_and_retrains_on_schedule():
    namespace: dict = {}
    torch.manual_seed(0)
    code = block("docs-bayesopt", page("bayesopt.md"))
    exec(compile(code, "bayesopt.md", "exec"), namespace)  # noqa: S102
    model, X, Y = namespace["model"], namespace["X"], namespace["Y"]
    assert X.shape == (30, 2) and Y.shape == (30, 1)
    assert model.trainings == 3  # the initial design, after 10 and after 20 more
    assert model.observations_since_training == 0
    assert Y[10:].max() > Y[:10].max()  # the loop found a better point
