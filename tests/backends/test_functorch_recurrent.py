"""``DiffFuncGGN`` on recurrent regressors (``nn.RNN``/``nn.LSTM``/``nn.GRU``).

``vmap`` cannot batch their fused kernels, so the backend takes ``jacrev`` per
sample. The reference is plain autograd: one ``torch.autograd.grad`` per sample
and output, in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import Laplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffFuncGGN
from tests.references import assert_same_state, model_state

RECURRENT = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}
layers = pytest.mark.parametrize("layer", RECURRENT.values(), ids=RECURRENT)


class Regressor(nn.Module):
    """A recurrent layer over ``(batch, time, 3)``, a linear head on the last step."""

    def __init__(self, layer: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = layer(3, 4, num_layers=2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _model(layer, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return Regressor(layer).to(dtype).eval()


def _inputs(dtype=torch.float64, n: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, 3, generator=gen, dtype=dtype)


def _autograd_jacobians(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for xi in x:
        out = model(xi[None])[0]
        rows.append(
            torch.stack(
                [
                    torch.cat(
                        [
                            g.flatten()
                            for g in torch.autograd.grad(o, params, retain_graph=True)
                        ]
                    )
                    for o in out
                ]
            )
        )
    return torch.stack(rows)


@layers
def test_jacobians_equal_autograd(layer):
    model, x = _model(layer), _inputs()
    before = model_state(model)
    Js, f = DiffFuncGGN(model, "regression").jacobians(x)
    assert_same_state(before, model_state(model))
    torch.testing.assert_close(
        Js, _autograd_jacobians(model, x), rtol=1e-10, atol=1e-10
    )
    torch.testing.assert_close(f, model(x).detach(), rtol=1e-12, atol=1e-12)


@layers
def test_float32_runs_without_warnings(layer):
    model, x = _model(layer, torch.float32), _inputs(torch.float32)
    Js, _ = DiffFuncGGN(model, "regression").jacobians(x)
    ref = _autograd_jacobians(model, x)
    torch.testing.assert_close(Js, ref, rtol=1e-4, atol=1e-5)


def test_backprop_to_input_and_selected_outputs():
    model = _model(nn.LSTM)
    x = _inputs().requires_grad_(True)
    backend = DiffFuncGGN(model, "regression")
    Js, _ = backend.jacobians(x, enable_backprop=True)
    (g,) = torch.autograd.grad(Js.square().sum(), x)
    x_ref = x.detach().clone().requires_grad_(True)
    params = list(model.parameters())
    total = 0.0
    for i in range(x.shape[0]):
        out = model(x_ref[i : i + 1])[0]
        for o in out:
            grads = torch.autograd.grad(o, params, create_graph=True)
            total = total + sum(gr.square().sum() for gr in grads)
    (g_ref,) = torch.autograd.grad(total, x_ref)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)
    sel = torch.tensor([1, 0, 1, 1])
    Js_sel, _ = backend.selected_output_jacobians(x.detach(), sel)
    torch.testing.assert_close(Js_sel[:, 0], Js.detach()[torch.arange(4), sel])


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_laplace_on_lstm_equals_curvlinops(structure):
    model = _model(nn.LSTM)
    gen = torch.Generator().manual_seed(4)
    X = torch.randn(8, 5, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    fits = []
    for backend in (DiffFuncGGN, CurvlinopsGGN):
        la = Laplace(
            copy.deepcopy(model), "regression", "all", structure, backend=backend
        )
        la.fit(loader)
        fits.append(la)
    ours, ref = fits
    # CurvlinopsGGN's ``full`` multiplies by a float32 identity: rtol 1e-5.
    torch.testing.assert_close(
        ours.posterior_precision, ref.posterior_precision, rtol=1e-5, atol=1e-8
    )
    torch.testing.assert_close(
        ours.log_marginal_likelihood(), ref.log_marginal_likelihood(), rtol=1e-5, atol=0
    )
