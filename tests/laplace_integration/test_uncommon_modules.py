"""laplace-torch flavours on models with PReLU and recurrent cells (B != C).

The curvature is compared with the GGN built from the per-sample autograd loop (to
1e-10) and with laplace-torch's ``CurvlinopsGGN`` on the same float64 model (which
differs from the loop's GGN by up to 1e-7 relative here, so to 1e-6); where a
structure is refused, the error's suggested structure and backend must work.
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


@pytest.mark.parametrize("name", list(MODELS))
def test_diag_laplace_with_difffuncggn_equals_the_loop_ggn(name):
    model = MODELS[name]()
    H = _fit(model, "diag", DiffFuncGGN).H
    torch.testing.assert_close(H, _loop_ggn(model).diagonal(), rtol=1e-10, atol=1e-10)
    H_curvlinops = _fit(model, "diag", CurvlinopsGGN).H
    torch.testing.assert_close(H, H_curvlinops, rtol=1e-6, atol=1e-7)


def test_backpack_diag_of_cells_is_refused_with_a_working_route():
    model = _cell_net()
    with pytest.raises(UnsupportedModuleError, match="GRUCell") as info:
        _fit(model, "diag", DiffBackPackGGN)
    assert "hessian_structure='full' works" in str(info.value)
    _fit(model, "diag", DiffFuncGGN)


def test_backpack_diag_refusal_names_structures_that_work():
    model = _prelu_mlp()
    with pytest.raises(UnsupportedModuleError, match="PReLU") as info:
        _fit(model, "diag", DiffBackPackGGN)
    message = str(info.value)
    assert "hessian_structure='full' works" in message
    assert "'diag' and 'full' work with laplace_diffjac.DiffFuncGGN" in message
    assert "kron" not in message  # no backend factorises PReLU
    _fit(model, "full", DiffBackPackGGN)
    _fit(model, "diag", DiffFuncGGN)


@pytest.mark.parametrize("backend", [DiffFuncGGN, DiffBackPackGGN])
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
