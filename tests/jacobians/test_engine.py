"""``jacobian_factors``: detached unless asked, for every module it factors."""

from __future__ import annotations

import pytest
import torch

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
