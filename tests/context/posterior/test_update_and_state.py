"""ContextPosterior.update equals a fit on the union; state round trips; bad input."""

from __future__ import annotations

import io

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import ContextPosterior, LocationFunctionalLaplace
from laplace_diffjac.errors import InvalidInputError
from tests.conftest import CASES
from tests.references import reference_jacobians

MLP = CASES[1]


def _targets(likelihood, x, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if likelihood == "regression":
        return torch.randn((len(x), 3), generator=gen, dtype=x.dtype)
    return torch.randint(0, 3, (len(x),), generator=gen)


def _outputs(la, xs):
    Js, _ = reference_jacobians(la.model, xs)
    gen = torch.Generator().manual_seed(0)
    return [
        la.functional_covariance(Js),
        la.predictive_samples(xs, n_samples=4, generator=gen),
        la.log_marginal_likelihood(),
    ]


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
@pytest.mark.parametrize("structure", ["scalar", "layerwise"])
def test_update_equals_fit_on_union(likelihood, structure):
    x, z, xs = MLP.inputs(23, 1), MLP.inputs(4, 2), MLP.inputs(3, 3)
    y = _targets(likelihood, x)
    kw = dict(prior_precision=0.7, prior_structure=structure, batch_size=6)
    la = ContextPosterior(MLP.model(), likelihood, z, **kw).fit((x[:10], y[:10]))
    la.update(x[10:17], y[10:17]).update(x[17:], y[17:])
    union = ContextPosterior(MLP.model(), likelihood, z, **kw).fit((x, y))
    assert la.n_data == union.n_data == 23
    for a, b in zip(_outputs(la, xs), _outputs(union, xs)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_update_before_fit_raises():
    la = ContextPosterior(MLP.model(), "regression", MLP.inputs(4, 2))
    with pytest.raises(RuntimeError, match="fit"):
        la.update(MLP.inputs(3))


def _round_trip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_state_dict_round_trip_is_exact(likelihood):
    x, z, xs = MLP.inputs(15, 1), MLP.inputs(4, 2), MLP.inputs(3, 3)
    hyper = dict(prior_precision=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    if likelihood == "regression":
        hyper["sigma_noise"] = 0.3
    la = ContextPosterior(MLP.model(), likelihood, z, temperature=2.0, **hyper)
    la.fit((x, _targets(likelihood, x)))
    state = _round_trip(la.state_dict())
    other = ContextPosterior(MLP.model(), likelihood, MLP.inputs(2, 5))
    other.load_state_dict(state)
    for a, b in zip(_outputs(la, xs), _outputs(other, xs)):
        assert torch.equal(a, b)


def test_state_dict_mismatch_errors():
    x, z = MLP.inputs(15, 1), MLP.inputs(4, 2)
    state = ContextPosterior(MLP.model(), "regression", z).fit(x).state_dict()
    small = CASES[0]  # one output: other parameter count
    la = ContextPosterior(small.model(), "regression", small.inputs(2))
    with pytest.raises(ValueError, match="different parameters"):
        la.load_state_dict(state)
    la = ContextPosterior(MLP.model(), "classification", z)
    with pytest.raises(ValueError, match="likelihoods"):
        la.load_state_dict(state)
    with pytest.raises(ValueError, match="wrong Laplace type"):
        la.load_state_dict({"mean": torch.zeros(3)})


@pytest.mark.parametrize("output_hessian", ["diagonal", "full"])
def test_location_functional_laplace_state_round_trip(output_hessian):
    x, z, xs = MLP.inputs(15, 1), MLP.inputs(4, 2), MLP.inputs(3, 3)
    kw = dict(output_hessian=output_hessian, prior_precision=2.0)
    la = LocationFunctionalLaplace(MLP.model(), "classification", z, **kw)
    la.fit((x, _targets("classification", x)))
    other = LocationFunctionalLaplace(MLP.model(), "classification", z, **kw)
    other.load_state_dict(_round_trip(la.state_dict()))
    assert torch.equal(la(xs), other(xs))
    wrong = LocationFunctionalLaplace(MLP.model(), "regression", z, **kw)
    with pytest.raises(ValueError, match="likelihood"):
        wrong.load_state_dict(la.state_dict())


def test_location_functional_laplace_reads_data_like_context_posterior():
    x, z, xs = MLP.inputs(15, 1), MLP.inputs(4, 2), MLP.inputs(3, 3)
    y = _targets("regression", x)
    ref = LocationFunctionalLaplace(MLP.model(), "regression", z)
    ref.fit(DataLoader(TensorDataset(x, y), batch_size=5))
    for data in (x, (x, y)):
        la = LocationFunctionalLaplace(MLP.model(), "regression", z)
        la.fit(data)
        assert la.n_data == 15
        for a, b in zip(la(xs), ref(xs)):
            torch.testing.assert_close(a, b)
    for a, b in zip(la(xs, pred_type="glm"), ref(xs, pred_type="gp")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same predictive
    with pytest.raises(ValueError, match="pred_type='gp' or 'glm'"):
        la(xs, pred_type="nn")


def test_locations_with_nan_raise():
    z = MLP.inputs(4, 2)
    z[1, 0] = float("nan")
    with pytest.raises(InvalidInputError, match="NaN"):
        ContextPosterior(MLP.model(), "regression", z)


def test_training_inputs_with_inf_raise_and_leave_posterior_unchanged():
    x, z = MLP.inputs(15, 1), MLP.inputs(4, 2)
    la = ContextPosterior(MLP.model(), "regression", z).fit(x)
    acc = la._acc
    bad = x.clone()
    bad[3, 1] = float("inf")
    with pytest.raises(InvalidInputError, match="train_loader"):
        la.fit(bad)
    loader = DataLoader(TensorDataset(bad, bad), batch_size=4)
    with pytest.raises(InvalidInputError, match="infinite"):
        la.fit(loader)
    assert la._acc is acc
    with pytest.raises(InvalidInputError, match="x_new"):
        la.update(bad)


def test_feature_size_mismatch_raises():
    la = ContextPosterior(MLP.model(), "regression", MLP.inputs(4, 2))
    with pytest.raises(InvalidInputError, match="same features"):
        la.fit(torch.randn(5, 4, dtype=torch.float64))


def test_unknown_likelihood_raises():
    with pytest.raises(ValueError, match="likelihood must be"):
        ContextPosterior(MLP.model(), "poisson", MLP.inputs(4, 2))


def test_locations_in_another_dtype_than_the_model_raise():
    model = MLP.model().float()
    with pytest.raises(InvalidInputError, match=r"\.to\(torch.float32\)"):
        ContextPosterior(model, "regression", MLP.inputs(4, 2))  # float64


def test_evidence_without_targets_raises():
    la = ContextPosterior(MLP.model(), "regression", MLP.inputs(4, 2))
    la.fit(MLP.inputs(6))
    with pytest.raises(ValueError, match="targets"):
        la.log_marginal_likelihood()


def test_location_functional_laplace_refuses_an_unchecked_laplace_release(
    monkeypatch,
):
    import laplace_diffjac.laplace_integration._functional_laplace as lfl

    monkeypatch.setattr(lfl, "LAPLACE_VERSION", (0, 4))
    with pytest.raises(
        RuntimeError, match=r"checked against laplace-torch 0\.2\.3, 0\.3"
    ):
        LocationFunctionalLaplace(MLP.model(), "regression", MLP.inputs(4, 2))


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_a_state_of_format_1_is_read(likelihood):
    """0.1.0 saved the unwhitened sums B = L0 W L0^T and J_Z; they load."""
    from laplace_diffjac.kernels import jacobians

    x, z, xs = MLP.inputs(15, 1), MLP.inputs(4, 2), MLP.inputs(3, 3)
    y = _targets(likelihood, x)
    la = ContextPosterior(MLP.model(), likelihood, z).fit((x, y))
    state = la.state_dict()
    acc = state["accumulators"]
    L0 = acc["L0"]
    J_z = jacobians(la.backend, z, enable_backprop=False).to(torch.float64)
    K_zz = torch.einsum("mcp,nep->mcne", J_z, J_z).reshape(1, 12, 12)
    old = {
        "J_z": J_z,
        "K_zz": K_zz,
        "B": L0 @ acc["W"] @ L0.T,
        **{k: acc[k] for k in ("ggn_diag", "loss", "n_data", "has_targets")},
    }
    state = {**state, "format": "laplace_diffjac.ContextPosterior/1",
             "accumulators": old}  # fmt: skip
    loaded = ContextPosterior(MLP.model(), likelihood, z)
    loaded.load_state_dict(state)
    for a, b in zip(_outputs(loaded, xs), _outputs(la, xs)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
