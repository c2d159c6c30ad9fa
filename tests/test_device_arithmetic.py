"""``laplace_diffjac._device_arithmetic``: float64's rate, and the default dtype.

The CUDA branch runs in ``tests/test_devices.py`` on a GPU; here the CPU's, and the
context posterior's ``compute_dtype='auto'`` against an explicit float64 posterior.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import ContextPosterior
from laplace_diffjac._device_arithmetic import (
    default_compute_dtype,
    float64_at_full_rate,
)


def test_a_cpu_runs_float64_at_full_rate_and_computes_in_it():
    cpu = torch.device("cpu")
    assert float64_at_full_rate(cpu)
    assert default_compute_dtype(cpu) is torch.float64


def _float32_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2))


def test_auto_on_a_cpu_is_the_float64_posterior():
    model = _float32_model()
    x, y = torch.randn(30, 3), torch.randn(30, 2)
    z, test = x[:6], torch.randn(5, 3)
    auto = ContextPosterior(model, "regression", z).fit((x, y))
    wide = ContextPosterior(model, "regression", z, compute_dtype=torch.float64)
    narrow = ContextPosterior(model, "regression", z, compute_dtype=None)
    wide.fit((x, y))
    narrow.fit((x, y))
    mean, var = auto(test)
    assert mean.dtype == var.dtype == torch.float32  # returned in the model's
    wide_mean, wide_var = wide(test)
    torch.testing.assert_close(var, wide_var, rtol=0, atol=0)
    torch.testing.assert_close(mean, wide_mean, rtol=0, atol=0)
    assert float(auto.log_marginal_likelihood()) == float(
        wide.log_marginal_likelihood()
    )
    # and the model's own float32 differs: the default is not float32 here
    _, narrow_var = narrow(test)
    assert not torch.equal(narrow_var, var)


def test_an_unknown_compute_dtype_string_is_refused_and_names_the_choices():
    model = _float32_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="'auto'"):
        ContextPosterior(model, "regression", torch.randn(4, 3), compute_dtype="fast")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
