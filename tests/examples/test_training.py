"""The demo's MAP network does not depend on the CPU's instruction set.

Trained in float32, 1,000 full-batch Adam steps amplified the rounding differences
between PyTorch's AVX-512 and AVX2 kernels into another network (and so other demo
numbers on other machines). ``train_mlp`` trains in float64: the network trained
with the default kernels and with AVX2 forced (``ATEN_CPU_CAPABILITY``,
``MKL_CBWR``) agree. On a machine without AVX-512 both runs use AVX2, so the test
still runs and passes; it guards the fix where it matters.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.processes import python_env

_TRAIN = """
import json, torch
from laplace_diffjac.examples.datasets import make_regression_gap
from laplace_diffjac.examples.settings import DemoSettings
from laplace_diffjac.examples.training import train_mlp
settings = DemoSettings.for_task("regression", None, None, quick=False)
x, y = make_regression_gap(settings.n, torch.Generator().manual_seed(0))
model = train_mlp(x, y, settings, seed=0)
print(json.dumps([p.detach().double().flatten().tolist() for p in model.parameters()]))
"""


def _trained(**env: str) -> list[float]:
    done = subprocess.run(
        [sys.executable, "-c", _TRAIN],
        env={**python_env(), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return [v for p in json.loads(done.stdout.strip().splitlines()[-1]) for v in p]


@pytest.mark.slow
def test_the_map_network_is_the_same_with_avx2_kernels():
    default = _trained()
    avx2 = _trained(ATEN_CPU_CAPABILITY="avx2", MKL_CBWR="AVX2")
    assert len(default) == len(avx2)
    worst = max(abs(a - b) for a, b in zip(default, avx2))
    assert worst < 1e-4, worst
