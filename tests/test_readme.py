"""The ten-line example (README and getting started) runs, and what it claims holds."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.docs import README, block, page, readme_block
from tests.references import reference_jacobians

#: The ten lines, in the README and on the getting-started page.
TEN_LINES = [(README, "readme-example"), (page("getting-started.md"), "docs-example")]


@pytest.mark.parametrize(("path", "marker"), TEN_LINES, ids=["README", "docs"])
def test_ten_line_example_runs_and_moves_only_x(path: Path, marker: str):
    namespace: dict = {}
    torch.manual_seed(0)
    exec(compile(block(marker, path), path.name, "exec"), namespace)  # noqa: S102
    x, model, backend = namespace["x"], namespace["model"], namespace["backend"]
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._backward_hooks for m in model.modules())
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())
    assert not torch.allclose(x, torch.linspace(-2, 2, 8).unsqueeze(1))

    # The example's gradient equals a float64 torch.func reference at the final x.
    model64 = copy.deepcopy(model).double()
    x64 = x.detach().double().requires_grad_(True)
    J_ref, _ = reference_jacobians(model64, x64)
    K_ref = J_ref.flatten(1) @ J_ref.flatten(1).T
    (g_ref,) = torch.autograd.grad(-torch.logdet(K_ref + torch.eye(8).double()), x64)
    x_now = x.detach().clone().requires_grad_(True)
    Js, _ = backend.jacobians(x_now, enable_backprop=True)
    K = Js.flatten(1) @ Js.flatten(1).T
    (g,) = torch.autograd.grad(-torch.logdet(K + torch.eye(8)), x_now)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-3, atol=1e-5)


def test_locations_example_runs():
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 64).unsqueeze(1)
    y = torch.sin(2 * x) + 0.1 * torch.randn_like(x)
    model = torch.nn.Sequential(
        torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=32
    )
    namespace = {
        "model": model,
        "train_loader": loader,
        "x_test": torch.linspace(-3, 3, 7).unsqueeze(1),
    }
    code = block("docs-locations", page("locations.md"))
    exec(compile(code, "locations.md", "exec"), namespace)  # noqa: S102
    assert namespace["Z"].shape == (16, 1)
    assert namespace["K"].shape == (7, 16, 1, 1)
    assert namespace["var"].shape[0] == 7 and torch.all(namespace["var"] > 0)


def test_readme_commands_are_the_ones_ci_runs():
    main = readme_block("main-command").strip()
    test = readme_block("test-command").strip()
    assert main.endswith("python -m laplace_diffjac")
    assert 'pip install -e ".[test]"' in test and test.endswith("python -m pytest -n 2")
    ci = (README.parent / ".ci" / "run").read_text()
    assert "test-command" in ci
    # the README command runs first in its fresh environment: no pip install before it
    lines = [line.strip() for line in ci.splitlines()]
    code = [line for line in lines if not line.startswith("#")]
    readme_run = code.index('bash -c "$test_command" || readme_rc=$?')
    installs = [i for i, line in enumerate(code) if "pip install" in line]
    assert installs and min(installs) > readme_run
    assert code.index("rm -rf .venv") < readme_run


@pytest.mark.parametrize("marker", ["main-command", "test-command"])
def test_getting_started_shows_the_readme_commands(marker: str):
    assert block(marker, page("getting-started.md")) == readme_block(marker)
