"""The full-Laplace reference against laplace-torch's ``FullLaplace`` itself."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffBackPackGGN
from studies.real.data import load_split
from studies.real.reference import FullReference
from studies.real.training import make_mlp


def _small_full(task: str) -> tuple[FullReference, torch.nn.Module, DataLoader]:
    name = "wine" if task == "classification" else "diabetes"
    s = load_split(name, 68)
    torch.manual_seed(0)
    model = make_mlp(s.x_train.shape[1], s.n_outputs, width=6).eval()
    loader = DataLoader(TensorDataset(s.x_train, s.y_train), batch_size=64)
    return (
        FullReference(
            model, task, loader, sigma_noise=0.7 if task == "regression" else 1.0
        ),
        model,
        loader,
    )


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_reference_matches_full_laplace(task: str) -> None:
    ref, model, _ = _small_full(task)
    la = ref.la
    x = load_split("wine" if task == "classification" else "diabetes", 68).x_test[:7]
    Js, _ = DiffBackPackGGN(model, task).jacobians(x)
    proj = Js.double() @ ref.eigenvectors
    for delta in (0.3, 3.0):
        la.prior_precision = delta
        expected = float(la.log_marginal_likelihood())
        assert ref.log_evidence(delta) == pytest.approx(expected, rel=1e-4)
        var = la.functional_variance(Js).diagonal(dim1=1, dim2=2).double()
        assert torch.allclose(ref.latent_variance(proj, delta), var, rtol=1e-3)
    best = ref.best_delta()
    assert ref.log_evidence(best) >= ref.log_evidence(best * 1.05)
    assert ref.log_evidence(best) >= ref.log_evidence(best / 1.05)
