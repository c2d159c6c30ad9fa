"""The last-layer Laplace row: its variances are laplace-torch's own predictive."""

from __future__ import annotations

import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffBackPackGGN
from studies.real.methods import LastLayerPosterior


def _fitted(likelihood: str, delta: float) -> tuple[LastLayerPosterior, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 6),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 6),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 2),
    )
    X = torch.randn(40, 3)
    y = torch.randn(40, 2) if likelihood == "regression" else torch.randint(0, 2, (40,))
    la = Laplace(
        model,
        likelihood,
        subset_of_weights="last_layer",
        hessian_structure="full",
        backend=DiffBackPackGGN,
        sigma_noise=0.7 if likelihood == "regression" else 1.0,
        prior_precision=delta,
    )
    la.fit(DataLoader(TensorDataset(X, y), batch_size=16))
    return LastLayerPosterior(la), X[:5]


def _full_jacobians(posterior: LastLayerPosterior, x: torch.Tensor) -> torch.Tensor:
    model = posterior.la.model.model if hasattr(posterior.la.model, "model") else None
    model = model or posterior.la.model
    backend = DiffBackPackGGN(model, "regression")
    Js, _ = backend.jacobians(x, enable_backprop=False)
    return Js


def test_variance_from_full_jacobians_is_laplace_torchs_predictive() -> None:
    posterior, x = _fitted("regression", 2.0)
    _, f_var = posterior.la(x, pred_type="glm")
    Js = _full_jacobians(posterior, x)
    assert Js.shape[-1] > posterior.la.n_params  # really the full network's
    got = posterior.functional_variance(Js)
    assert torch.allclose(got, f_var, rtol=1e-5, atol=1e-7)


def test_prior_precision_set_after_fit_equals_a_refit() -> None:
    posterior, x = _fitted("classification", 0.5)
    posterior.prior_precision = torch.tensor([3.0], dtype=torch.float64)
    refit, _ = _fitted("classification", 3.0)
    Js = _full_jacobians(posterior, x)
    assert torch.allclose(
        posterior.functional_variance(Js), refit.functional_variance(Js), rtol=1e-5
    )
    delta = torch.tensor([3.0])
    assert torch.allclose(
        posterior.log_marginal_likelihood(delta), refit.log_marginal_likelihood(delta)
    )
