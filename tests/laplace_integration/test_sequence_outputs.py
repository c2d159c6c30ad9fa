"""Last-layer Laplace on sequence models (laplace-torch issues #265/#266).

The head is applied to every token, ``(batch, seq, D) -> (batch, seq, C)``, and the
model returns one row per sample (the first or last token's logits, or their mean).
laplace-torch 0.3 takes such models with ``feature_reduction``; the last-layer
Jacobians are then the reduced features in its ``(batch, C, C * D + C)`` layout.
Compared with float64 ``torch.func`` Jacobians and with laplace-torch's own
``CurvlinopsGGN`` fits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import Laplace
from laplace.curvature import CurvlinopsGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN
from tests.conftest import ON_LAPLACE_03
from tests.laplace_integration.helpers import assert_close
from tests.references import reference_jacobians

pytestmark = pytest.mark.skipif(
    not ON_LAPLACE_03, reason="feature_reduction exists in laplace-torch 0.3"
)

REDUCTIONS = ["pick_first", "pick_last", "average"]
backends = pytest.mark.parametrize(
    "backend", [DiffBackPackGGN, DiffFuncGGN], ids=lambda b: b.__name__
)


class TokenClassifier(nn.Module):
    """Per-token logits, reduced over the sequence the way ``reduction`` names."""

    def __init__(self, reduction: str, n_classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 5), nn.Tanh())
        self.head = nn.Linear(5, n_classes)
        self.reduction = reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(x))  # (batch, seq, C)
        if self.reduction == "pick_first":
            return logits[:, 0]
        if self.reduction == "pick_last":
            return logits[:, -1]
        return logits.mean(dim=1)


@pytest.fixture(autouse=True)
def _float64_default():
    """CurvlinopsGGN's ``full`` multiplies by ``torch.eye`` in the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _model(reduction: str) -> nn.Module:
    torch.manual_seed(0)
    return TokenClassifier(reduction).double().eval()


def _loader() -> DataLoader:
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(12, 4, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=gen)
    return DataLoader(TensorDataset(X, y), batch_size=6)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@backends
def test_last_layer_jacobians_equal_torch_func(backend, reduction):
    from laplace.utils import FeatureExtractor

    model = _model(reduction)
    x = _loader().dataset.tensors[0][:5]
    extractor = FeatureExtractor(
        copy.deepcopy(model), last_layer_name="head", feature_reduction=reduction
    )
    b = backend(extractor, "classification", last_layer=True)
    for enable_backprop in (False, True):
        Js, f = b.last_layer_jacobians(x, enable_backprop=enable_backprop)
        J_ref, f_ref = reference_jacobians(model, x, list(model.head.parameters()))
        torch.testing.assert_close(Js, J_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(f, f_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@backends
def test_last_layer_laplace_equals_curvlinops(backend, reduction, structure):
    fits = []
    for b in (backend, CurvlinopsGGN):
        la = Laplace(
            _model(reduction),
            "classification",
            "last_layer",
            structure,
            backend=b,
            feature_reduction=reduction,
        )
        la.fit(_loader())
        fits.append(la)
    ours, ref = fits
    if structure == "kron":
        assert_close(ours.H_facs, ref.H_facs, "kron factors")
    else:
        assert_close(ours.posterior_precision, ref.posterior_precision, "precision")
    assert_close(ours.log_marginal_likelihood(), ref.log_marginal_likelihood())
    x = _loader().dataset.tensors[0][:4]
    assert_close(ours(x, pred_type="glm"), ref(x, pred_type="glm"), "predictive")


def test_unreduced_sequence_features_are_refused_clearly():
    from laplace.utils import FeatureExtractor

    from laplace_diffjac.errors import UnsupportedModuleError

    extractor = FeatureExtractor(_model("pick_last"), last_layer_name="head")
    x = _loader().dataset.tensors[0][:2]
    with pytest.raises(UnsupportedModuleError, match="feature_reduction"):
        DiffFuncGGN(extractor, "classification", last_layer=True).last_layer_jacobians(
            x
        )
