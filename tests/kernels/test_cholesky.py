import pytest
import torch

from laplace_diffjac.kernels import explained_trace, jittered_cholesky


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


def _explained_case(seed=0, n_z=3, b=4, c=2):
    gen = torch.Generator().manual_seed(seed)
    F = torch.randn(n_z * c + b * c, 9, generator=gen, dtype=torch.float64)
    K = F @ F.T
    K_zz, K_zx = K[: n_z * c, : n_z * c], K[: n_z * c, n_z * c :]
    R = torch.randn(b, c, c, generator=gen, dtype=torch.float64)
    return K_zz.clone(), K_zx.clone(), R @ R.transpose(1, 2)


def _explained_reference(K_zz, K_zx, lam, jitter):
    n = K_zz.shape[0]
    K = K_zz + jitter * K_zz.diagonal().mean() * torch.eye(n, dtype=K_zz.dtype)
    Q = K_zx.T @ torch.linalg.solve(K, K_zx)
    b, c = lam.shape[:2]
    blocks = torch.einsum("acae->ace", Q.reshape(b, c, b, c))
    return torch.einsum("bce,bce->", lam, blocks)


def test_explained_trace_matches_solve_reference_and_gradients():
    K_zz, K_zx, lam = _explained_case()
    args = [t.clone().requires_grad_() for t in (K_zz, K_zx, lam)]
    value = explained_trace(*args, 1e-3)
    ref_args = [t.clone().requires_grad_() for t in (K_zz, K_zx, lam)]
    ref = _explained_reference(*ref_args, 1e-3)
    torch.testing.assert_close(value, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(value, args)
    ref_grads = torch.autograd.grad(ref, ref_args)
    # K_zz: the symmetric gradient (a Gram is a symmetric function of its inputs)
    sym = 0.5 * (ref_grads[0] + ref_grads[0].T)
    torch.testing.assert_close(grads[0], sym, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], ref_grads[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[2], ref_grads[2], rtol=1e-10, atol=1e-12)


def test_explained_trace_gradcheck_through_a_symmetric_gram():
    _, _, lam = _explained_case()
    gen = torch.Generator().manual_seed(1)
    Fz = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    Fx = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda f: explained_trace(f @ f.T, f @ Fx.T, lam, 1e-4), (Fz,)
    )


def test_explained_trace_errors():
    K_zz, K_zx, lam = _explained_case()
    with pytest.raises(ValueError, match="Shapes"):
        explained_trace(K_zz, K_zx[:, :-1], lam, 1e-6)
    with pytest.raises(ValueError, match="jitter"):
        explained_trace(K_zz, K_zx, lam, -1.0)
    with pytest.raises(torch.linalg.LinAlgError, match="jitter"):
        explained_trace(-K_zz, K_zx, lam, 0.0)
