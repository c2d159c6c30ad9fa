"""Contract 5: optimising inputs through J frees every input; memory stays flat."""

from __future__ import annotations

import gc
import weakref

import psutil
import pytest
import torch

from tests.backends.methods import kron_friendly_mlp
from tests.conftest import BACKENDS


def _step(backend, x):
    J, f = backend.jacobians(x, enable_backprop=True)
    n = J.shape[0] * J.shape[1]
    K = torch.einsum("bcp,dep->bcde", J, J).reshape(n, n)
    eye = torch.eye(K.shape[0], dtype=K.dtype)
    return -torch.logdet(K + eye) + 1e-3 * (f**2).sum()


@pytest.mark.slow
@pytest.mark.parametrize("backend_cls", BACKENDS, ids=lambda c: c.__name__)
def test_inputs_are_freed_and_memory_is_flat(backend_cls):
    torch.manual_seed(0)
    backend = backend_cls(kron_friendly_mlp(), "classification")
    z = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([z], lr=1e-2)
    refs = []
    process = psutil.Process()
    rss = []
    for step in range(300):
        opt.zero_grad()
        x = z * 1.0  # a fresh non-leaf input each step, as in a real pipeline
        leaf = z.detach().clone().requires_grad_(True)  # and a fresh leaf
        loss = _step(backend, x) + _step(backend, leaf)
        loss.backward()
        opt.step()
        refs += [weakref.ref(x), weakref.ref(leaf)]
        del x, leaf, loss
        if step in (50, 299):
            gc.collect()
            rss.append(process.memory_info().rss)
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of {len(refs)} inputs are still reachable"
    assert rss[1] - rss[0] < 20 * 2**20, (
        f"RSS grew by {(rss[1] - rss[0]) / 2**20:.1f} MiB"
    )


def test_inputs_are_freed_without_gc():
    """No reference cycle at all: plain reference counting frees the input."""
    backend = BACKENDS[0](kron_friendly_mlp(), "classification")
    gc.disable()
    try:
        x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        ref = weakref.ref(x)
        _step(backend, x).backward()
        del x
        assert ref() is None
    finally:
        gc.enable()
