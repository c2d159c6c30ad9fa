"""Bad input to the context posterior: a clear error at the call that received it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import ContextPosterior, evidence_loss_backward
from laplace_diffjac.backends import as_backend
from laplace_diffjac.errors import InvalidInputError
from tests.references import assert_same_state, model_state


def _one_output_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _three_class_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3)).double()


X = torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
Z = X[:4]


@pytest.mark.parametrize("as_loader", [False, True])
def test_regression_targets_of_the_wrong_shape_fail_in_fit(as_loader):
    model = _one_output_model()
    y = torch.randn(12, 2, dtype=torch.float64)
    data = DataLoader(TensorDataset(X, y), batch_size=5) if as_loader else (X, y)
    cp = ContextPosterior(model, "regression", Z)
    before = model_state(model)
    with pytest.raises(InvalidInputError, match=r"train_loader.*\(5, 2\)|\(12, 2\)"):
        cp.fit(data)
    assert cp.n_data == 0  # nothing kept
    assert_same_state(before, model_state(model))


def test_targets_are_checked_in_update_and_the_evidence_objective():
    model = _one_output_model()
    cp = ContextPosterior(model, "regression", Z).fit((X, X[:, :1]))
    with pytest.raises(InvalidInputError, match=r"x_new.*\(3, 2\).*pass targets"):
        cp.update(X[:3], torch.zeros(3, 2, dtype=torch.float64))
    assert cp.n_data == 12
    Zg = Z.clone().requires_grad_()
    with pytest.raises(InvalidInputError, match=r"targets have shape \(12, 2\)"):
        evidence_loss_backward(
            as_backend(model, "regression", None),
            Zg,
            (X, torch.zeros(12, 2, dtype=torch.float64)),
            "regression",
            torch.ones(1, dtype=torch.float64),
            torch.ones((), dtype=torch.float64),
        )


@pytest.mark.parametrize(
    ("y", "match"),
    [
        (
            torch.zeros(12, dtype=torch.float64),
            r"class indices are torch.float64.*long",
        ),
        (torch.full((12,), 3), r"class indices must lie in \[0, 3\)"),
        (torch.zeros(12, 2, dtype=torch.long), r"shape \(12, 2\)"),
    ],
)
def test_classification_targets_are_checked(y, match):
    cp = ContextPosterior(_three_class_model(), "classification", Z)
    with pytest.raises(InvalidInputError, match=match):
        cp.fit((X, y))


def test_class_probabilities_are_accepted():
    model = _three_class_model()
    probs = torch.softmax(torch.randn(12, 3, dtype=torch.float64), -1)
    cp = ContextPosterior(model, "classification", Z).fit((X, probs))
    assert torch.isfinite(cp.log_marginal_likelihood())


def test_locations_of_the_wrong_feature_size_fail_in_the_constructor():
    model = _one_output_model()
    before = model_state(model)
    with pytest.raises(InvalidInputError, match=r"locations has feature shape \(5,\)"):
        ContextPosterior(model, "regression", torch.zeros(4, 5, dtype=torch.float64))
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("where", ["locations", "fit", "predict"])
def test_integer_inputs_into_float_layers_name_the_cast(where):
    model = _one_output_model()
    ints = torch.zeros(4, 3, dtype=torch.long)
    match = r"integer or boolean tensor of dtype torch.int64.*\.to\(torch.float64\)"
    with pytest.raises(InvalidInputError, match=match):
        if where == "locations":
            ContextPosterior(model, "regression", ints)
        cp = ContextPosterior(model, "regression", Z)
        if where == "fit":
            cp.fit(ints)
        cp.fit(X)
        cp(ints)


@pytest.mark.parametrize("where", ["locations", "fit", "predict"])
def test_an_unbatched_input_is_named_as_such(where):
    model = _one_output_model()
    one = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match=r"unbatched input.*unsqueeze\(0\)"):
        if where == "locations":
            ContextPosterior(model, "regression", one)
        cp = ContextPosterior(model, "regression", Z)
        if where == "fit":
            cp.fit(one)
        cp.fit(X)
        cp(one)
