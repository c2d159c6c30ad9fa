"""kernels/_lapack.py against torch.linalg, on the SciPy route and the torch one."""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac.kernels._lapack import (
    cholesky_in_place,
    solve_lower,
    solve_lower_transposed,
)


def _spd(n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    X = torch.randn(n, 2 * n, generator=gen, dtype=torch.float64)
    return (X @ X.T / n + 0.1 * torch.eye(n, dtype=torch.float64)).to(dtype)


@pytest.fixture(params=[1, 2], ids=["one-thread", "two-threads"])
def threads(request):
    """PyTorch's intra-op threads for the test (1: SciPy's route, 2: torch's)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [1, 7, 130])
def test_factor_and_solves_match_torch_linalg(n, dtype, threads):
    K = _spd(n, dtype)
    B = torch.randn(n, 5, generator=torch.Generator().manual_seed(0), dtype=dtype)
    L_ref = torch.linalg.cholesky(K)
    L, info = cholesky_in_place(K.clone())
    assert info == 0
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(torch.tril(L), L_ref, **tol)
    want = torch.linalg.solve_triangular(L_ref, B, upper=False)
    torch.testing.assert_close(solve_lower(L, B), want, **tol)
    want_t = torch.linalg.solve_triangular(L_ref.T, B, upper=True)
    torch.testing.assert_close(solve_lower_transposed(L, B), want_t, **tol)


def test_non_contiguous_right_hand_side():
    K = _spd(9, torch.float64)
    B = torch.randn(5, 9, dtype=torch.float64).T  # (9, 5), not contiguous
    L, _ = cholesky_in_place(K.clone())
    want = torch.linalg.solve_triangular(torch.linalg.cholesky(K), B, upper=False)
    torch.testing.assert_close(solve_lower(L, B), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_not_positive_definite_reports_the_minor(dtype):
    K = _spd(6, dtype)
    K[3, 3] = -1.0
    _, info = cholesky_in_place(K.clone())
    assert info == 4  # 1-based order of the first non-positive leading minor


def test_scipy_blas_runs_on_one_thread():
    from laplace_diffjac.kernels._lapack import _controller, _torch_threads

    with _torch_threads():
        blas = [i for i in _controller().info() if i["user_api"] == "blas"]
        assert blas and {i["num_threads"] for i in blas} == {1}


def test_scipy_only_when_torch_runs_on_one_thread(threads, monkeypatch):
    """One thread pool at a time: with several threads only torch.linalg runs."""
    import laplace_diffjac.kernels._lapack as route

    calls = []
    real = route.lapack.dpotrf
    monkeypatch.setattr(
        route.lapack, "dpotrf", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    K = _spd(8, torch.float64)
    L, info = cholesky_in_place(K.clone())
    assert info == 0
    assert len(calls) == (1 if threads == 1 else 0)
