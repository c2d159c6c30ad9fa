"""The Bayesian-optimisation page's loop runs as written, without warnings."""

from __future__ import annotations

import pytest
import torch

from tests.docs import block, page

pytest.importorskip("botorch")


@pytest.mark.slow
# BoTorch's own notice that L-BFGS-B's line search stopped on one restart (it then
# restarts from new points). It depends on the last bits of the trained network,
# not on this package's code paths; every other warning stays an error. The
# acquisition's gradients are checked by gradcheck in test_context_botorch.py.
@pytest.mark.filterwarnings(
    "ignore:Optimization failed in `gen_candidates_scipy`:RuntimeWarning"
)
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
