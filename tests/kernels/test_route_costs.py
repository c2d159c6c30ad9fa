"""``laplace_diffjac.kernels._route_costs`` and the route :func:`ntk` takes by them.

The counts are checked against the work written out by hand (a matmul's
multiply-adds and bytes, a view that launches nothing); the choice against a
per-sample float64 autograd loop, whichever route it takes, and against what the
counts predict on a CPU and on a launch-bound GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.kernels import _ntk
from laplace_diffjac.kernels._ntk import ntk, ntk_diag, prior_variance
from laplace_diffjac.kernels._route_costs import (
    COUNTING_AVAILABLE,
    DeviceCosts,
    StepWork,
    Work,
    count_work,
    device_costs,
)
from tests.references import loop_jacobians

pytestmark = pytest.mark.skipif(
    not COUNTING_AVAILABLE, reason="counting needs torch >= 2.1"
)

#: A launch-bound GPU: launches dominate, matmuls are nearly free.
GPU_LIKE = DeviceCosts(6e-6, 2e-6, 2.5e13, 2e12)


class SmallCNN(nn.Module):
    """Two 3×3 convolutions and a Linear head on 1×8×8 inputs (10 outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3)
        self.head = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        return self.head(torch.relu(self.conv2(h)).flatten(1))


def test_count_work_of_a_matmul_and_its_gradient():
    a = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    forward = count_work(lambda: a @ b)
    assert forward.kernels == 1
    assert forward.madds == 3 * 4 * 5
    assert forward.bytes == (3 * 4 + 4 * 5 + 3 * 5) * 8
    view = count_work(lambda: a.t())
    assert (view.kernels, view.views, view.madds, view.bytes) == (0, 1, 0, 0)

    def step() -> None:
        out = a @ b
        torch.autograd.grad(out, [a, b], torch.ones_like(out))

    both = count_work(step)  # forward, and one matmul for each gradient
    assert both.madds == 3 * (3 * 4 * 5)
    assert a.grad is None and b.grad is None


def test_step_work_grows_as_fitted():
    alpha, beta = (7.0, 11.0), (5.0, 3.0)

    def work(b: int) -> Work:
        return Work(
            40, 9, alpha[0] * b + beta[0] * b * b, alpha[1] * b + beta[1] * b * b
        )

    steps = StepWork(work(4), work(8), (4, 8), outputs=3)
    got = steps.at(64, 64, symmetric=True)
    assert (got.kernels, got.views) == (40, 9)
    assert got.madds == pytest.approx(7.0 * 64 + 5.0 * 64**2)
    assert got.bytes == pytest.approx(11.0 * 64 + 3.0 * 64**2)
    cross = steps.at(6, 2, symmetric=False)
    assert cross.madds == pytest.approx(7.0 * 8 + 5.0 * 12)
    one = StepWork(work(1), work(1), (1, 1), outputs=3).at(1, 1, symmetric=True)
    assert one.madds == pytest.approx(12.0)


def test_step_work_of_a_transformer_extrapolates_to_its_count_at_64():
    """Counted on 4 and 8 sequences, the work at B = 64 is within 30 % of the
    work counted at 64 (counted on one and two, the bytes came out 4.6× too high)."""
    from laplace_diffjac.kernels._ntk import _budget_route
    from laplace_diffjac.kernels._route_costs import step_work
    from tests.class_models import built

    model, x = built("token-transformer", 64)
    backend = DiffBackPackGGN(model, "classification")
    prior_var = prior_variance(
        1.0, _ntk.n_jacobian_columns(backend), torch.empty((), dtype=torch.float64)
    )
    route = _budget_route(backend, True, None, prior_var=prior_var)
    fitted = step_work(route, x, prior_var, True).at(64, 64, symmetric=True)
    counted = _count_at(route, x, prior_var)
    assert fitted.madds == pytest.approx(counted.madds, rel=0.3)
    assert fitted.bytes == pytest.approx(counted.bytes, rel=0.3)


def _count_at(route, x, prior_var) -> Work:
    from laplace_diffjac.kernels._route_costs import count_work

    def step() -> None:
        feats = route.features(x)
        K = route.pair(feats, feats, prior_var)
        params = [p for p in route.params if p.requires_grad]
        torch.autograd.grad(K, params, torch.ones_like(K), allow_unused=True)

    return count_work(step)


def test_device_costs_add_up_and_float64_halves_a_cpu_rate():
    cpu32 = device_costs(torch.device("cpu"), torch.float32)
    cpu64 = device_costs(torch.device("cpu"), torch.float64)
    assert cpu64.madds_per_second == pytest.approx(cpu32.madds_per_second / 2)
    work = Work(10, 4, 1e9, 1e8)
    expected = (
        10 * cpu32.seconds_per_kernel
        + 4 * cpu32.seconds_per_view
        + 1e9 / cpu32.madds_per_second
        + 1e8 / cpu32.bytes_per_second
    )
    assert cpu32.seconds(work) == pytest.approx(expected)


def _chosen(backend, x, monkeypatch=None, costs=None) -> bool:
    if costs is not None:
        monkeypatch.setattr(_ntk, "device_costs", lambda device, dtype: costs)
    prior_var = prior_variance(
        1.0, _ntk.n_jacobian_columns(backend), torch.empty((), dtype=x.dtype)
    )
    size = len(x)
    grad = _ntk._gradient_possible(backend.params, prior_var, x)
    return _ntk._factors_cheaper(
        backend, x, (size, size), True, grad, prior_var, None, 2**30
    )


def _cnn_and_inputs(batch: int):
    torch.manual_seed(0)
    model = SmallCNN().double()
    x = torch.randn(batch, 1, 8, 8, dtype=torch.float64, requires_grad=True)
    return model, x


def test_a_launch_bound_device_takes_the_jacobian_route_for_a_small_cnn(monkeypatch):
    model, x = _cnn_and_inputs(4)
    backend = DiffBackPackGGN(model, "classification")
    assert not _chosen(backend, x, monkeypatch, GPU_LIKE)


def test_a_cpu_keeps_the_factor_route_for_the_same_cnn_at_a_batch_of_32():
    model, x = _cnn_and_inputs(32)
    assert _chosen(DiffBackPackGGN(model, "classification"), x)


def test_a_launch_bound_device_keeps_the_factor_route_at_width(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4)
    ).double()
    x = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
    assert _chosen(DiffBackPackGGN(model, "classification"), x, monkeypatch, GPU_LIKE)


@pytest.mark.parametrize("device_kind", ["cpu", "launch-bound"])
@pytest.mark.parametrize(
    "kernel, layout",
    [(ntk, "acp,bep->abce"), (ntk_diag, "acp,aep->ace")],
    ids=["ntk", "ntk_diag"],
)
def test_kernels_equal_a_per_sample_loop_on_the_route_they_take(
    monkeypatch, device_kind, kernel, layout
):
    """Value and gradient in ``x``, whichever route the counts choose."""
    if device_kind == "launch-bound":
        monkeypatch.setattr(_ntk, "device_costs", lambda device, dtype: GPU_LIKE)
    model, x = _cnn_and_inputs(4)
    backend = DiffBackPackGGN(model, "classification")
    K = kernel(backend, x, prior_precision=0.5)
    (grad,) = torch.autograd.grad((K**2).sum(), x)
    leaf = x.detach().clone().requires_grad_()
    J, _ = loop_jacobians(model, leaf)
    reference = 2.0 * torch.einsum(layout, J, J)
    (expected,) = torch.autograd.grad((reference**2).sum(), leaf)
    torch.testing.assert_close(K, reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())


def test_a_jacobian_route_that_would_need_chunks_gives_way(monkeypatch):
    """Under a budget too small for the Jacobians whole, the factor route runs."""
    import laplace_diffjac

    monkeypatch.setattr(_ntk, "device_costs", lambda device, dtype: GPU_LIKE)
    model, x = _cnn_and_inputs(4)
    backend = DiffBackPackGGN(model, "classification")
    prior_var = prior_variance(
        1.0, _ntk.n_jacobian_columns(backend), torch.empty((), dtype=x.dtype)
    )

    def route_taken() -> bool:
        factors, _, _ = _ntk._gram_route(
            backend, True, True, x, (4, 4), True, True, prior_var, None, 256
        )
        return factors

    assert not route_taken()
    with laplace_diffjac.memory_budget("1 MiB"):
        assert route_taken()
        K = ntk(backend, x)
    J, _ = loop_jacobians(model, x.detach())
    torch.testing.assert_close(K, torch.einsum("acp,bep->abce", J, J))


def test_a_jacobian_route_chosen_but_too_large_for_the_budget_gives_way(monkeypatch):
    """The estimate may favour J where one input's J with its graph does not fit
    the budget at all: the factor route then runs, instead of an error."""
    import laplace_diffjac

    monkeypatch.setattr(_ntk, "_factors_cheaper", lambda *args, **kwargs: False)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4)
    ).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    backend = DiffBackPackGGN(model, "classification")
    prior_var = prior_variance(
        1.0, _ntk.n_jacobian_columns(backend), torch.empty((), dtype=x.dtype)
    )
    with laplace_diffjac.memory_budget("1 MiB"):  # one input's J: 2.2 MB
        factors, _, _ = _ntk._gram_route(
            backend, True, True, x, (4, 4), True, True, prior_var, None, 256
        )
        assert factors
        K = ntk(backend, x)
    factors, _, _ = _ntk._gram_route(
        backend, True, True, x, (4, 4), True, True, prior_var, None, 256
    )
    assert not factors  # with room, the (forced) Jacobian route runs
    J, _ = loop_jacobians(model, x.detach())
    torch.testing.assert_close(K, torch.einsum("acp,bep->abce", J, J))
