import pytest
import torch

from laplace_diffjac.kernels import jittered_cholesky


def test_factor_of_symmetrised_matrix_with_relative_jitter():
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    K = A @ A.T  # rank 3: singular without jitter
    K_asym = K + 1e-12 * torch.randn(5, 5, generator=gen, dtype=torch.float64)
    L = jittered_cholesky(K_asym, 1e-6)
    expected = 0.5 * (K_asym + K_asym.T) + 1e-6 * K.diagonal().mean() * torch.eye(5)
    torch.testing.assert_close(L @ L.T, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(L, L.tril())


def test_zero_matrix_and_scale_invariance():
    L = jittered_cholesky(torch.zeros(3, 3, dtype=torch.float64), 1e-8)
    assert torch.isfinite(L).all() and (L.diagonal() > 0).all()
    K = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(
        jittered_cholesky(1e6 * K, 1e-3), 1e3 * jittered_cholesky(K, 1e-3)
    )


def test_jitter_is_differentiable_part_of_the_function():
    K0 = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    t = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: jittered_cholesky(t * K0, 0.1), (t,))


def test_bad_arguments():
    with pytest.raises(ValueError, match="jitter"):
        jittered_cholesky(torch.eye(2), -1.0)
    with pytest.raises(ValueError, match="square"):
        jittered_cholesky(torch.ones(2, 3), 0.0)
