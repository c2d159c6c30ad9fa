"""laplace-torch flavours on models with PReLU and recurrent cells (B != C).

The curvature is compared with the GGN built from the per-sample autograd loop (to
1e-10) and with laplace-torch's ``CurvlinopsGGN`` on the same float64 model (which
differs from the loop's GGN by up to 1e-7 relative here, so to 1e-6); where a
structure is refused, the error's suggested structure and backend must work.
``DiffBackPackGGN``'s Kronecker factors of parameters without a KFAC rule are the
exact block (one-dimensional) or its nearest Kronecker product (a dense SVD).
"""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import Laplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN, UnsupportedModuleError
from tests.references import loop_jacobians

N_POINTS, BATCH = 10, 5


class _CellNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.cell(x))


def _prelu_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 2)).double()


def _cell_net() -> nn.Module:
    torch.manual_seed(0)
    return _CellNet().double()


MODELS = {"prelu": _prelu_mlp, "grucell": _cell_net}


def _data() -> tuple[torch.Tensor, DataLoader]:
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(N_POINTS, 3, generator=gen, dtype=torch.float64)
    Y = torch.randn(N_POINTS, 2, generator=gen, dtype=torch.float64)
    return X, DataLoader(TensorDataset(X, Y), batch_size=BATCH)


def _fit(model: nn.Module, structure: str, backend: type):
    _, loader = _data()
    la = Laplace(
        copy.deepcopy(model),
        "regression",
        subset_of_weights="all",
        hessian_structure=structure,
        backend=backend,
    )
    la.fit(loader)
    return la


def _loop_ggn(model: nn.Module) -> torch.Tensor:
    """``Σ_n J_nᵀ J_n`` (regression, unit noise) from the autograd loop."""
    X, _ = _data()
    J, _ = loop_jacobians(model, X)
    return torch.einsum("bcp,bcq->pq", J, J).detach()


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("prelu", DiffFuncGGN),
        ("prelu", DiffBackPackGGN),
        ("grucell", DiffFuncGGN),
        ("grucell", DiffBackPackGGN),  # the engine's local rule
    ],
)
def test_full_laplace_equals_the_loop_ggn_and_curvlinops(name, backend):
    model = MODELS[name]()
    H = _fit(model, "full", backend).H
    torch.testing.assert_close(H, _loop_ggn(model), rtol=1e-10, atol=1e-10)
    H_curvlinops = _fit(model, "full", CurvlinopsGGN).H
    torch.testing.assert_close(H, H_curvlinops, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", [DiffFuncGGN, DiffBackPackGGN])
@pytest.mark.parametrize("name", list(MODELS))
def test_diag_laplace_equals_the_loop_ggn(name, backend):
    model = MODELS[name]()
    H = _fit(model, "diag", backend).H
    torch.testing.assert_close(H, _loop_ggn(model).diagonal(), rtol=1e-10, atol=1e-10)
    H_curvlinops = _fit(model, "diag", CurvlinopsGGN).H
    torch.testing.assert_close(H, H_curvlinops, rtol=1e-6, atol=1e-7)


def _nearest_kronecker_product(H: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """``σ u ⊗ v`` of the top singular pair of the rearranged block (a dense SVD)."""
    R = H.reshape(m, n, m, n).permute(0, 2, 1, 3).reshape(m * m, n * n)
    U, S, Vh = torch.linalg.svd(R)
    return S[0] * torch.kron(U[:, 0].reshape(m, m), Vh[0].reshape(n, n))


@pytest.mark.parametrize("name", list(MODELS))
def test_backpack_kron_without_a_kfac_rule_is_the_exact_or_nearest_block(name):
    """PReLU's slopes (1-D): the exact block; a GRUCell's weights (local rule): the
    nearest Kronecker product of their exact block (Van Loan and Pitsianis)."""
    model = MODELS[name]()
    X, loader = _data()
    Y = loader.dataset.tensors[1]
    _, kron = DiffBackPackGGN(model, "regression").kron(X, Y, N=N_POINTS)
    H, start = _loop_ggn(model), 0
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    for p, factors in zip(model.parameters(), kron.kfacs):
        block = H[start : start + p.numel(), start : start + p.numel()]
        start += p.numel()
        if isinstance(owners[id(p)], nn.Linear):
            continue  # KFAC: tests/backends (against curvlinops and BackPACK)
        if p.dim() == 1:
            torch.testing.assert_close(factors[0], block, rtol=1e-10, atol=1e-12)
            continue
        expected = _nearest_kronecker_product(block, p.shape[0], p[0].numel())
        got = torch.kron(factors[0], factors[1])
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("backend", [DiffFuncGGN])
def test_kron_refusal_names_the_module_and_a_structure_that_works(backend):
    model = _prelu_mlp()
    with pytest.raises(UnsupportedModuleError, match="PReLU") as info:
        _fit(model, "kron", backend)
    message = str(info.value)
    assert "'full'" in message and "'kron' work" not in message
    if backend is DiffFuncGGN:
        assert "with this backend" in message
        _fit(model, "diag", DiffFuncGGN)
    _fit(model, "full", backend)
