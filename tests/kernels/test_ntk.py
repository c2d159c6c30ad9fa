"""``laplace_diffjac.kernels._ntk`` against float64 ``torch.func`` references."""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac.kernels._ntk import ntk, ntk_diag
from tests.references import reference_jacobians


def _reference_ntk(model, x1, x2, prior_var):
    J1, _ = reference_jacobians(model, x1)
    J2, _ = reference_jacobians(model, x2)
    return torch.einsum("acp,p,bep->abce", J1, prior_var.expand(J1.shape[-1]), J2)


def _prior_vector(model, seed=3):
    gen = torch.Generator().manual_seed(seed)
    P = sum(p.numel() for p in model.parameters())
    return 0.5 + torch.rand(P, generator=gen, dtype=torch.float64)


def test_ntk_matches_reference(case, backend_cls):
    model = case.model()
    x1, x2 = case.inputs(5, seed=1), case.inputs(3, seed=2)
    prec = _prior_vector(model)
    backend = backend_cls(model, "regression")
    K = ntk(backend, x1, x2, prior_precision=prec, chunk_size=2, structured=False)
    expected = _reference_ntk(model, x1, x2, 1 / prec.double())
    assert K.shape == (5, 3, case.n_outputs, case.n_outputs)
    torch.testing.assert_close(K, expected, rtol=1e-10, atol=1e-12)


def test_ntk_symmetric_and_diag(case):
    from laplace_diffjac import DiffBackPackGGN

    model = case.model()
    x = case.inputs(5)
    backend = DiffBackPackGGN(model, "classification")
    K = ntk(backend, x, chunk_size=2, structured=False)
    torch.testing.assert_close(K, K.permute(1, 0, 3, 2), rtol=0, atol=1e-12)
    torch.testing.assert_close(K, _reference_ntk(model, x, x, torch.tensor(1.0)))
    diag = ntk_diag(backend, x, chunk_size=3)
    torch.testing.assert_close(diag, torch.einsum("aace->ace", K))


def test_ntk_auto_route_matches_reference(case):
    from laplace_diffjac import DiffBackPackGGN

    model = case.model()
    x1, x2 = case.inputs(4, seed=1), case.inputs(3, seed=2)
    K = ntk(DiffBackPackGGN(model, "regression"), x1, x2, prior_precision=0.7)
    torch.testing.assert_close(K, _reference_ntk(model, x1, x2, torch.tensor(1 / 0.7)))


def test_ntk_gradients_match_reference(case, backend_cls):
    """Gradients of a random functional of K w.r.t. x1, x2 and the parameters."""
    model = case.model()
    x1 = case.inputs(4, seed=1).requires_grad_()
    x2 = case.inputs(3, seed=2).requires_grad_()
    weights = torch.randn(
        4, 3, case.n_outputs, case.n_outputs, generator=torch.Generator().manual_seed(5)
    ).double()
    params = list(model.parameters())
    prec = _prior_vector(model)

    backend = backend_cls(model, "regression")
    K = ntk(backend, x1, x2, prior_precision=prec, chunk_size=2, structured=False)
    inputs = [x1, x2, *params]
    got = torch.autograd.grad(
        (K * weights).sum(), inputs, allow_unused=True, materialize_grads=True
    )
    K_ref = _reference_ntk(model, x1, x2, 1 / prec)
    want = torch.autograd.grad(
        (K_ref * weights).sum(), inputs, allow_unused=True, materialize_grads=True
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("structured", [None, False])
def test_ntk_of_one_tensor_twice_matches_reference(case, structured):
    """``ntk(b, x, x)`` (one tensor passed twice) takes the symmetric route: its
    Gram and its gradients in ``x`` and the parameters are the reference's."""
    from laplace_diffjac import DiffBackPackGGN

    model = case.model()
    x = case.inputs(5, seed=1).requires_grad_()
    weights = torch.randn(
        5, 5, case.n_outputs, case.n_outputs, generator=torch.Generator().manual_seed(7)
    ).double()
    params = list(model.parameters())
    backend = DiffBackPackGGN(model, "regression")
    K = ntk(backend, x, x, prior_precision=0.7, chunk_size=2, structured=structured)
    K_ref = _reference_ntk(model, x, x, torch.tensor(1 / 0.7, dtype=torch.float64))
    torch.testing.assert_close(K, K_ref, rtol=1e-10, atol=1e-12)
    got = torch.autograd.grad((K * weights).sum(), [x, *params], allow_unused=True)
    want = torch.autograd.grad((K_ref * weights).sum(), [x, *params], allow_unused=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_ntk_gradcheck_locations():
    from laplace_diffjac import DiffBackPackGGN
    from tests.conftest import CASES

    case = CASES[1]  # mlp-C3
    model = case.model()
    backend = DiffBackPackGGN(model, "regression")
    x1 = case.inputs(3, seed=1)
    z = case.inputs(2, seed=2).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: ntk(backend, x1, z, chunk_size=1, structured=False), (z,)
    )
    assert torch.autograd.gradcheck(
        lambda z: ntk(backend, z, chunk_size=1, structured=False), (z,)
    )


def test_ntk_subnetwork_backend(backend_cls):
    from tests.conftest import CASES

    case = CASES[1]
    model = case.model()
    P = sum(p.numel() for p in model.parameters())
    idx = torch.arange(0, P, 3)
    backend = backend_cls(model, "regression", subnetwork_indices=idx)
    x1, x2 = case.inputs(3, seed=1), case.inputs(2, seed=2)
    prec = _prior_vector(model)[idx]
    K = ntk(backend, x1, x2, prior_precision=prec)
    J1 = reference_jacobians(model, x1)[0][..., idx]
    J2 = reference_jacobians(model, x2)[0][..., idx]
    torch.testing.assert_close(K, torch.einsum("acp,p,bep->abce", J1, 1 / prec, J2))


def test_ntk_float64_accumulation_from_float32():
    from laplace_diffjac import DiffFuncGGN
    from tests.conftest import CASES

    case = CASES[1]
    model = case.model()
    x = case.inputs(4)
    expected = _reference_ntk(model, x, x, torch.tensor(1.0))
    model32 = model.float()
    K = ntk(DiffFuncGGN(model32, "regression"), x.float(), dtype=torch.float64)
    assert K.dtype == torch.float64
    torch.testing.assert_close(K, expected, rtol=1e-5, atol=1e-5)


def test_ntk_rejects_bad_prior_and_chunk():
    from laplace_diffjac import DiffFuncGGN
    from tests.conftest import CASES

    case = CASES[0]
    backend = DiffFuncGGN(case.model(), "regression")
    x = case.inputs(2)
    with pytest.raises(ValueError, match="entries"):
        ntk(backend, x, prior_precision=torch.ones(3))
    with pytest.raises(ValueError, match="positive"):
        ntk(backend, x, prior_precision=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        ntk(backend, x, chunk_size=0)


def test_structured_required_but_not_applicable():
    from laplace_diffjac import DiffFuncGGN
    from tests.conftest import CASES

    case = CASES[2]  # a CNN on DiffFuncGGN: no route without J
    backend = DiffFuncGGN(case.model(), "regression")
    with pytest.raises(ValueError, match="structured"):
        ntk(backend, case.inputs(2), structured=True)


def test_any_backends_chain_takes_the_engine_with_any_prior():
    """An ``nn.Sequential`` chain on ``DiffFuncGGN`` goes through the engine's
    factors (never ``J``), also with a per-parameter prior, where the features'
    scalar-prior Grams do not apply."""
    from laplace_diffjac import DiffFuncGGN
    from tests.conftest import CASES

    mlp = CASES[1]
    model = mlp.model()
    backend = DiffFuncGGN(model, "regression")
    n_params = sum(p.numel() for p in model.parameters())
    prec = torch.linspace(0.5, 2.0, n_params, dtype=torch.float64)
    x1, x2 = mlp.inputs(3, 1), mlp.inputs(2, 2)
    K = ntk(backend, x1, x2, prior_precision=prec, structured=True)
    torch.testing.assert_close(K, _reference_ntk(model, x1, x2, 1 / prec))
    D = ntk_diag(backend, x1, prior_precision=prec)
    torch.testing.assert_close(
        D, _reference_ntk(model, x1, x1, 1 / prec).diagonal(0, 0, 1).permute(2, 0, 1)
    )


def test_ntk_leaves_model_untouched(case, backend_cls):
    from tests.references import assert_same_state, model_state

    model = case.model()
    before = model_state(model)
    x = case.inputs(3).requires_grad_()
    K = ntk(backend_cls(model, "regression"), x, chunk_size=2)
    torch.autograd.grad(K.sum(), x)
    assert x.grad is None
    assert_same_state(before, model_state(model))
