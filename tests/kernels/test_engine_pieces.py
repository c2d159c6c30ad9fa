"""The engine's pieces: Linear features where every block is a Linear layer's.

Every Gram is compared with the float64 per-sample autograd loop
(``tests.references.loop_jacobians``), never with the factor route it replaces.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.context.locations._routes import FactorRoute
from laplace_diffjac.jacobians._engine import JacobianFactors
from laplace_diffjac.kernels import ntk, ntk_diag
from laplace_diffjac.kernels._engine_pieces import engine_pieces
from laplace_diffjac.kernels._structured_features import NTKFeatures
from tests.references import loop_jacobians

F64 = torch.float64


class ClassMLP(nn.Module):
    """A 4-6-5-3 MLP written as a class, a frozen middle bias (not a Sequential)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(4, 6)
        self.middle = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)
        self.middle.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.middle(torch.sigmoid(self.inner(x)))))


def _reference(model, x1, x2, var):
    params = [p for p in model.parameters() if p.requires_grad]
    J1, _ = loop_jacobians(model, x1, params)
    J2, _ = loop_jacobians(model, x2, params)
    C = J1.shape[1]
    return torch.einsum("acp,bep->acbe", J1, J2).reshape(len(x1) * C, -1) * var


def _inputs(batch: int, seed: int, shape=(4,)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *shape, generator=gen, dtype=F64)


def test_a_class_mlp_gets_linear_features_and_the_reference_grams():
    model = ClassMLP().double()
    backend = DiffBackPackGGN(model, "classification")
    var = torch.tensor(0.4, dtype=F64)
    route = FactorRoute(backend, var)
    z = _inputs(3, 1).requires_grad_()
    x = _inputs(5, 2)
    pz, px = route.pieces(z, True), route.pieces(x, False)
    assert isinstance(pz, NTKFeatures) and isinstance(px, NTKFeatures)
    # weight and bias of a layer share one signal: three layers, the middle
    # one without its (frozen) bias, the last one's signals the identity
    assert pz.weight == (True, True, True) and pz.bias == (True, False, True)
    assert pz.signals[-1] is None
    K = route.cross(pz, px)
    torch.testing.assert_close(K, _reference(model, z, x, var), rtol=1e-10, atol=0)
    S = route.self_gram(pz)
    torch.testing.assert_close(S, _reference(model, z, z, var), rtol=1e-10, atol=0)
    D = route.diag(px)
    ref_d = _reference(model, x, x, var).reshape(5, 3, 5, 3).diagonal(0, 0, 2)
    torch.testing.assert_close(D, ref_d.permute(2, 0, 1), rtol=1e-10, atol=0)
    # the gradient in the locations, against the reference's
    w = torch.randn(K.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    (g,) = torch.autograd.grad((K * w).sum() + S.square().sum(), z)
    z_ref = z.detach().clone().requires_grad_()
    ref = (_reference(model, z_ref, x, var) * w).sum()
    ref = ref + _reference(model, z_ref, z_ref, var).square().sum()
    (g_ref,) = torch.autograd.grad(ref, z_ref)
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "model",
    [
        lambda: nn.Sequential(
            nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4, 3)
        ),  # positions
        lambda: nn.Sequential(nn.Embedding(7, 4), nn.Flatten(), nn.Linear(8, 2)),
    ],
    ids=["conv", "embedding"],
)
def test_other_blocks_stay_factors(model):
    torch.manual_seed(0)
    net = model().double()
    backend = DiffBackPackGGN(net, "classification")
    if isinstance(net[0], nn.Embedding):
        x = torch.randint(0, 7, (3, 2))
    else:
        x = _inputs(3, 1, (1, 3, 4))
    scalar = torch.tensor(1.0, dtype=F64)
    assert isinstance(engine_pieces(backend, x, False, True), JacobianFactors)
    assert isinstance(FactorRoute(backend, scalar).pieces(x, False), JacobianFactors)


def test_a_per_parameter_prior_keeps_the_factors():
    model = ClassMLP().double()
    backend = DiffBackPackGGN(model, "classification")
    n = sum(p.numel() for p in backend.params)
    var = torch.linspace(0.5, 1.5, n, dtype=F64)
    route = FactorRoute(backend, var)
    x = _inputs(3, 1)
    assert isinstance(route.pieces(x, False), JacobianFactors)


def _relu_output_model() -> nn.Module:
    """``relu(W x + b)``: constant signals, the identity where all outputs are > 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(3, 4, dtype=F64))
        model[0].bias.zero_()
    return model


def test_identity_in_one_batch_only_is_written_out():
    """One batch's signals are the identity (every output positive), the other's
    are not: the Grams, the gradient and a concatenation still equal the
    reference."""
    model = _relu_output_model()
    backend = DiffBackPackGGN(model, "classification")
    var = torch.tensor(0.7, dtype=F64)
    route = FactorRoute(backend, var)
    positive = _inputs(3, 1).abs() + 0.5
    mixed = _inputs(4, 2)
    mixed[:, 0] = -1.0  # output 0 is cut by the ReLU for every input
    p_pos, p_mix = route.pieces(positive, False), route.pieces(mixed, False)
    assert isinstance(p_pos, NTKFeatures) and isinstance(p_mix, NTKFeatures)
    assert p_pos.signals[0] is None and p_mix.signals[0] is not None
    for a, b, xa, xb in [
        (p_pos, p_mix, positive, mixed),
        (p_mix, p_pos, mixed, positive),
    ]:
        ref = _reference(model, xa, xb, var)
        torch.testing.assert_close(route.cross(a, b), ref, rtol=1e-12, atol=0)
    both = route.cat([p_pos, p_mix])
    ref = _reference(model, torch.cat([positive, mixed]), mixed, var)
    torch.testing.assert_close(route.cross(both, p_mix), ref, rtol=1e-12, atol=0)
    z = positive.clone().requires_grad_()
    K = route.cross(route.pieces(z, True), p_mix)
    (g,) = torch.autograd.grad(K.square().sum(), z)
    z_ref = positive.clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(
        _reference(model, z_ref, mixed, var).square().sum(), z_ref
    )
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)
    # ntk's chunks: the first chunk all positive, the second not
    x = torch.cat([positive, mixed])
    K_ntk = ntk(backend, x, chunk_size=3, prior_precision=1 / 0.7)
    ref = _reference(model, x, x, var).reshape(7, 3, 7, 3).permute(0, 2, 1, 3)
    torch.testing.assert_close(K_ntk, ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
def test_ntk_of_a_chain_equals_the_reference_on_every_backend(backend_cls):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)
    ).double()
    backend = backend_cls(model, "classification")
    x1 = _inputs(4, 1).requires_grad_()
    x2 = _inputs(3, 2)
    K = ntk(backend, x1, x2, prior_precision=2.0)
    ref = _reference(model, x1, x2, 0.5).reshape(4, 2, 3, 2).permute(0, 2, 1, 3)
    torch.testing.assert_close(K, ref, rtol=1e-10, atol=0)
    D = ntk_diag(backend, x2, prior_precision=2.0)
    ref_d = _reference(model, x2, x2, 0.5).reshape(3, 2, 3, 2).diagonal(0, 0, 2)
    torch.testing.assert_close(D, ref_d.permute(2, 0, 1), rtol=1e-10, atol=0)
    assert torch.autograd.gradcheck(
        lambda a: ntk(backend, a, prior_precision=2.0),
        (x1.detach()[:2].requires_grad_(),),
    )
