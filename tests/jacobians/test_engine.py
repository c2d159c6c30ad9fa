"""``jacobian_factors``: detached unless asked, for every module it factors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac import DiffBackPackGGN, UnsupportedModuleError
from tests.backends.audit_cases import CASES


def _tensors(factors) -> list[torch.Tensor]:
    out = [factors.f]
    for entries in factors.factors.values():
        for entry in entries:
            out += [v for v in vars(entry).values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_factors_are_cut_from_the_graph_without_enable_backprop(name: str) -> None:
    case = CASES[name]
    model, x = case.model(), case.inputs()
    backend = DiffBackPackGGN(model, "regression")
    if x.is_floating_point():
        x = x.clone().requires_grad_()
    try:
        cut = backend.jacobian_factors(x)
    except UnsupportedModuleError:  # refused alike by the Jacobians (the audit
        with pytest.raises(UnsupportedModuleError):  # checks why)
            backend.jacobians(x)
        return
    assert not any(t.requires_grad for t in _tensors(cut))
    kept = backend.jacobian_factors(x, enable_backprop=True)
    assert any(t.requires_grad for t in _tensors(kept))


def test_the_attention_kernel_is_chosen_wherever_attention_may_run() -> None:
    from laplace_diffjac.jacobians._forward import may_attend

    class Net(nn.Module):  # a forward of its own may call it
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    assert not may_attend(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)))
    assert may_attend(Net())
    assert may_attend(nn.Sequential(nn.MultiheadAttention(4, 2)))
    assert may_attend(nn.TransformerEncoderLayer(4, 2, 8))
