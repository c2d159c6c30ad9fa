"""DTC context posterior and FunctionalLaplace-on-locations against dense references."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from laplace import FunctionalLaplace
from laplace.utils.utils import SoDSampler
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.context import ContextPosterior
from laplace_diffjac.laplace_integration import (
    LocationFunctionalLaplace,
    functional_laplace_on_locations,
)
from tests.conftest import CASES
from tests.context.helpers import _blocks, _dense_gp, _lam, _per_input
from tests.references import reference_jacobians

MLP = CASES[1]  # mlp-C3, P = 77


def _dense_dtc(model, x, z, xs, likelihood, prec, sigma):
    Jx, fx = reference_jacobians(model, x)
    Jz, _ = reference_jacobians(model, z)
    Js, _ = reference_jacobians(model, xs)
    lam = torch.block_diag(*_lam(fx.detach(), likelihood, sigma))
    Kzz, Kzx, Kzs = _blocks(Jz, Jz, prec), _blocks(Jz, Jx, prec), _blocks(Jz, Js, prec)
    Kss = _blocks(Js, Js, prec)
    mid = torch.linalg.inv(Kzz) - torch.linalg.inv(Kzz + Kzx @ lam @ Kzx.T)
    return Kss - Kzs.T @ mid @ Kzs


def _dense_full(model, x, xs, likelihood, prec, sigma):
    Jx, fx = reference_jacobians(model, x)
    Js, _ = reference_jacobians(model, xs)
    lam = _lam(fx.detach(), likelihood, sigma)
    P = Jx.shape[-1]
    H = torch.einsum("ncp,nce,neq->pq", Jx, lam, Jx) + prec * torch.eye(P).double()
    Jflat = Js.reshape(-1, P)
    return Jflat @ torch.linalg.solve(H, Jflat.T)


@pytest.mark.parametrize("backend_cls", [DiffBackPackGGN, DiffFuncGGN])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_matches_dense_dtc_reference(backend_cls, likelihood):
    model = MLP.model()
    x, z, xs = MLP.inputs(20, 1), MLP.inputs(4, 2), MLP.inputs(5, 3)
    sigma = 0.3 if likelihood == "regression" else 1.0
    la = ContextPosterior(
        model,
        likelihood,
        z,
        sigma_noise=sigma,
        prior_precision=2.0,
        backend=backend_cls,
        jitter=0.0,
        batch_size=6,
    ).fit(DataLoader(TensorDataset(x), batch_size=7))  # needs no targets
    ref = _dense_dtc(model, x, z, xs, likelihood, 2.0, sigma)
    Js, f = reference_jacobians(model, xs)
    torch.testing.assert_close(la.functional_covariance(Js), ref)
    torch.testing.assert_close(la.functional_variance(Js), _per_input(ref, 5, 3))
    if likelihood == "regression":
        mean, var = la(xs)
        torch.testing.assert_close(mean, f)
        torch.testing.assert_close(var, _per_input(ref, 5, 3))
        _, var_diag = la(xs, diagonal_output=True)
        torch.testing.assert_close(var_diag, _per_input(ref, 5, 3).diagonal(0, 1, 2))
        mean_j, cov_j = la(xs, joint=True)
        torch.testing.assert_close(cov_j, ref)
        assert mean_j.shape == (15,)
    else:
        probs = la(xs, link_approx="probit")
        var = _per_input(ref, 5, 3).diagonal(0, 1, 2)
        expected = torch.softmax(f / torch.sqrt(1 + math.pi / 8 * var), -1)
        torch.testing.assert_close(probs, expected)
        gen = torch.Generator().manual_seed(0)
        mc = la(xs, link_approx="mc", n_samples=4000, generator=gen)
        torch.testing.assert_close(mc.sum(-1), torch.ones(5).double())
        assert (mc - expected).abs().max() < 0.1
        for link in ("bridge", "bridge_norm"):
            assert torch.allclose(
                la(xs, link_approx=link).sum(-1), torch.ones(5).double()
            )


@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_equals_full_ggn_posterior_when_locations_are_the_data(likelihood):
    """M = N, Z = X: the DTC posterior is the full-data GGN Laplace posterior."""
    model = MLP.model()
    x, xs = MLP.inputs(8, 1), MLP.inputs(4, 3)  # N C = 24 <= P = 77
    sigma = 0.5 if likelihood == "regression" else 1.0
    la = ContextPosterior(
        model, likelihood, x, sigma_noise=sigma, prior_precision=1.5, jitter=0.0
    ).fit(x)
    Js, _ = reference_jacobians(model, xs)
    full = _dense_full(model, x, xs, likelihood, 1.5, sigma)
    torch.testing.assert_close(la.functional_covariance(Js), full)


def test_sigma_noise_change_after_fit_and_vector_prior():
    model = MLP.model()
    x, z, xs = MLP.inputs(12, 1), MLP.inputs(3, 2), MLP.inputs(2, 3)
    P = sum(p.numel() for p in model.parameters())
    prec = torch.linspace(0.5, 2.0, P).double()
    la = ContextPosterior(model, "regression", z, prior_precision=prec, jitter=0.0)
    la.fit((x, x))
    la.sigma_noise = 0.2
    Jx, _ = reference_jacobians(model, x)
    Jz, _ = reference_jacobians(model, z)
    Js, _ = reference_jacobians(model, xs)

    def blocks(a, b):
        return torch.einsum("acp,p,bep->acbe", a, 1 / prec, b).reshape(
            a.shape[0] * 3, -1
        )

    Kzz, Kzx, Kzs = blocks(Jz, Jz), blocks(Jz, Jx), blocks(Jz, Js)
    mid = torch.linalg.inv(Kzz) - torch.linalg.inv(Kzz + Kzx @ Kzx.T / 0.04)
    ref = blocks(Js, Js) - Kzs.T @ mid @ Kzs
    torch.testing.assert_close(la.functional_covariance(Js), ref)


def test_enable_backprop_gradient_to_test_inputs():
    model = MLP.model()
    x, z = MLP.inputs(10, 1), MLP.inputs(3, 2)
    xs = MLP.inputs(2, 3).requires_grad_()
    la = ContextPosterior(model, "regression", z, jitter=0.0, enable_backprop=True)
    la.fit(x)
    mean, var = la(xs)
    (g,) = torch.autograd.grad(var.sum() + mean.sum(), xs)
    ref = _dense_dtc(model, x, z, xs, "regression", 1.0, 1.0)
    _, f = reference_jacobians(model, xs)
    (g_ref,) = torch.autograd.grad(_per_input(ref, 2, 3).sum() + f.sum(), xs)
    torch.testing.assert_close(g, g_ref)
    assert xs.grad is None


def test_errors():
    model = MLP.model()
    z = MLP.inputs(2)
    la = ContextPosterior(model, "regression", z)
    with pytest.raises(RuntimeError, match="fit"):
        la(z)
    la.fit(z)
    with pytest.raises(ValueError):
        la(z, pred_type="nn")
    with pytest.raises(ValueError):
        ContextPosterior(model, "classification", z, sigma_noise=2.0)


# laplace-torch's own BackPackGGN (the vanilla side) triggers this torch note.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
# laplace-torch 0.2.3 never clears its "prior changed" flag after fit.
@pytest.mark.filterwarnings("ignore:The prior precision has been changed since fit")
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_location_functional_laplace_equals_random_subset(likelihood):
    """Given the subset FunctionalLaplace would draw, the fitted GPs are identical.

    Predictive variances differ for C > 1 only by laplace-torch's ``K*M`` bug,
    which ``test_location_functional_laplace_matches_dense_gp`` covers; the mean
    and, for one output, the whole predictive agree.
    """
    for case in (CASES[0], MLP) if likelihood == "regression" else (MLP,):
        model = case.model()
        N, M = 30, 6
        x = case.inputs(N, 1)
        y = model(x).detach() if likelihood == "regression" else torch.arange(N) % 3
        loader = DataLoader(TensorDataset(x, y), batch_size=4)
        xs = case.inputs(5, 3)
        kwargs = {"prior_precision": 2.0}
        vanilla = FunctionalLaplace(
            copy.deepcopy(model), likelihood, n_subset=M, seed=3, **kwargs
        )
        vanilla.fit(loader)
        idx = SoDSampler(N=N, M=M, seed=3).indices
        ours = functional_laplace_on_locations(
            model, likelihood, x[idx], loader, **kwargs
        )
        assert ours.n_data == N
        torch.testing.assert_close(ours.K_MM, vanilla.K_MM)
        torch.testing.assert_close(ours.L, vanilla.L)
        torch.testing.assert_close(ours.Sigma_inv, vanilla.Sigma_inv)
        # J(z) θ* from the factors (the scatter means) against laplace-torch's J.
        torch.testing.assert_close(ours.mu, vanilla.mu)
        if likelihood == "regression":  # the same targets: y = f(x)
            torch.testing.assert_close(ours.loss, vanilla.loss)
        pred_v = vanilla(xs, pred_type="gp")
        pred_o = ours(xs, pred_type="gp")
        if likelihood == "regression":
            torch.testing.assert_close(pred_o[0], pred_v[0])
            if case.n_outputs == 1:
                torch.testing.assert_close(pred_o[1], pred_v[1])


@pytest.mark.parametrize("joint", [False, True])
@pytest.mark.parametrize("output_hessian", ["diagonal", "full"])
@pytest.mark.parametrize("reweight", [False, True])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_location_functional_laplace_matches_dense_gp(
    likelihood, reweight, output_hessian, joint
):
    """C = 3 against a float64 dense GP from reference Jacobians, both laplace-torch.

    Also checks that laplace-torch's own ``_build_K_star_M`` (which merges the test
    output axis with the subset index) does not match it, i.e. that the override
    is needed.
    """
    model = MLP.model()
    N, M, prec = 24, 4, 2.0
    sigma = 0.5 if likelihood == "regression" else 1.0
    x, z, xs = MLP.inputs(N, 1), MLP.inputs(M, 2), MLP.inputs(3, 3)
    y = model(x).detach() if likelihood == "regression" else torch.arange(N) % 3
    loader = DataLoader(TensorDataset(x, y), batch_size=5)
    kwargs = {"prior_precision": prec}
    if likelihood == "regression":
        kwargs["sigma_noise"] = sigma
    la = LocationFunctionalLaplace(
        model,
        likelihood,
        z,
        reweight=reweight,
        output_hessian=output_hessian,
        **kwargs,
    )
    la.fit(loader)
    scale, weight = (1.0, N / M) if reweight else (M / N, 1.0)
    ref = _dense_gp(
        model,
        z,
        xs,
        likelihood,
        prec,
        sigma,
        scale,
        weight,
        output_hessian == "full",
        joint,
    )
    Js, _ = reference_jacobians(model, xs)
    ours = la.functional_covariance(Js) if joint else la.functional_variance(Js)
    torch.testing.assert_close(ours, ref)
    # With reweight=False in regression the kernel (times M / N) is small next to
    # the noise, the subtracted term nearly vanishes and so does the bug's effect.
    if output_hessian == "diagonal" and (likelihood == "classification" or reweight):
        upstream = FunctionalLaplace._build_K_star_M
        K_M_star = [
            la.gp_kernel_prior_variance * la._kernel_batch_star(Js, Z)
            for Z, _ in la.train_loader
        ]
        K_ss = la.gp_kernel_prior_variance * la._kernel_star(Js)
        buggy = K_ss - upstream(la, K_M_star)
        assert not torch.allclose(buggy, _per_input(ref, 3, 3) if joint else ref)


@pytest.mark.parametrize("structured", [True, False], ids=["factors", "jacobians"])
@pytest.mark.parametrize("joint", [False, True])
@pytest.mark.parametrize("output_hessian", ["diagonal", "full"])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_location_functional_laplace_predicts_the_dense_gp_by_either_route(
    likelihood, output_hessian, joint, structured
):
    """``la(x)``'s latent predictive, from per-layer factors or from Jacobians.

    The factor route never forms the test inputs' Jacobians; both routes must
    give the float64 dense GP of reference Jacobians, and the network's output.
    """
    model = MLP.model()
    N, M, prec = 24, 4, 2.0
    x, z, xs = MLP.inputs(N, 1), MLP.inputs(M, 2), MLP.inputs(3, 3)
    y = model(x).detach() if likelihood == "regression" else torch.arange(N) % 3
    loader = DataLoader(TensorDataset(x, y), batch_size=5)
    la = LocationFunctionalLaplace(
        model, likelihood, z, output_hessian=output_hessian, prior_precision=prec,
        structured=structured,
    )  # fmt: skip
    la.fit(loader)
    ref = _dense_gp(
        model, z, xs, likelihood, prec, 1.0, M / N, 1.0, output_hessian == "full",
        joint,
    )  # fmt: skip
    if structured:  # the factor route forms no Jacobians of the test inputs

        def refuse(*args, **kwargs):
            raise AssertionError("the factor route called backend.jacobians")

        la.backend.jacobians = refuse
    f_mu, f_var = la._glm_predictive_distribution(xs, joint=joint)
    torch.testing.assert_close(f_var, ref, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        f = model(xs)
    torch.testing.assert_close(f_mu, f.flatten() if joint else f)
    assert not f_var.requires_grad  # enable_backprop=False


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_location_functional_laplace_fits_from_factors_as_from_jacobians(
    likelihood, case
):
    """The factor fit (no Jacobians) leaves laplace-torch's loop's state.

    ``K_MM`` against the float64 reference Jacobians' Gram, and every fitted
    quantity against ``structured=False`` (laplace-torch's own loop over batches
    of the locations, with Jacobians): the scatter means ``J (μ₀ − θ*)`` with a
    nonzero prior mean, the Hessians, the factor, the loss and the evidence.
    """
    model = case.model()
    N, M = 20, 5
    x, z = case.inputs(N, 1), case.inputs(M, 2)
    y = model(x).detach() if likelihood == "regression" else torch.arange(N) % 3
    loader = DataLoader(TensorDataset(x, y), batch_size=2)  # 3 location batches
    n_params = sum(p.numel() for p in model.parameters())
    prior_mean = 0.1 * torch.randn(n_params, generator=torch.Generator().manual_seed(4))
    kwargs = {"prior_precision": 1.5, "prior_mean": prior_mean.double()}
    fits = {}
    for structured in (True, False):
        la = LocationFunctionalLaplace(
            copy.deepcopy(model), likelihood, z, structured=structured, **kwargs
        )
        if structured:

            def refuse(*args, **kwargs):
                raise AssertionError("the factor fit called backend.jacobians")

            la.backend.jacobians = refuse
        la.fit(loader)
        fits[structured] = la
    ours, theirs = fits[True], fits[False]
    Jz, _ = reference_jacobians(model, z)
    P = Jz.shape[-1]
    torch.testing.assert_close(
        ours.K_MM, Jz.reshape(-1, P) @ Jz.reshape(-1, P).T, rtol=1e-10, atol=1e-12
    )
    for name in ("K_MM", "L", "mu", "Sigma_inv", "loss"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name))
    assert (ours.n_data, ours.n_outputs, ours.batch_size) == (
        theirs.n_data, theirs.n_outputs, theirs.batch_size,
    )  # fmt: skip
    assert ours.mu.abs().max() > 1e-3  # the prior mean's shift is not trivial
    torch.testing.assert_close(
        ours.log_marginal_likelihood(), theirs.log_marginal_likelihood()
    )
    xs = case.inputs(3, 3)
    for a, b in zip(ours(xs), theirs(xs)):
        torch.testing.assert_close(a, b)


def test_location_functional_laplace_factor_route_gradients_in_x():
    """The factor route's predictive variance is differentiable in ``x*``."""
    model = MLP.model()
    z = MLP.inputs(4, 2)
    x = MLP.inputs(20, 1)
    loader = DataLoader(TensorDataset(x, model(x).detach()), batch_size=5)
    la = LocationFunctionalLaplace(model, "regression", z, enable_backprop=True)
    la.fit(loader)
    xs = MLP.inputs(2, 3).requires_grad_(True)

    def variance(inputs):
        return la._glm_predictive_distribution(inputs)[1]

    assert torch.autograd.gradcheck(variance, (xs,))


def test_location_functional_laplace_options():
    model = MLP.model()
    z = MLP.inputs(3)
    with pytest.raises(ValueError, match="output_hessian"):
        LocationFunctionalLaplace(model, "regression", z, output_hessian="kron")
    with pytest.raises(ValueError, match="independent_outputs"):
        LocationFunctionalLaplace(
            model,
            "regression",
            z,
            output_hessian="full",
            independent_outputs=True,
        )


def test_location_functional_laplace_reweight():
    """reweight=True: no prior scaling, Hessians at the locations times N / M.

    Single output, written out; C = 3 is covered by
    ``test_location_functional_laplace_matches_dense_gp``.
    """
    model = CASES[0].model()
    N, M = 30, 5
    x, z = CASES[0].inputs(N, 1), CASES[0].inputs(M, 2)
    loader = DataLoader(TensorDataset(x, model(x).detach()), batch_size=8)
    la = LocationFunctionalLaplace(
        model, "regression", z, reweight=True, sigma_noise=0.5
    )
    la.fit(loader)
    xs = CASES[0].inputs(3, 3)
    _, var = la(xs, pred_type="gp")
    Jz, _ = reference_jacobians(model, z)
    Js, _ = reference_jacobians(model, xs)
    Kzz, Kzs, Kss = _blocks(Jz, Jz, 1.0), _blocks(Jz, Js, 1.0), _blocks(Js, Js, 1.0)
    noise = 0.25 * M / N * torch.eye(M).double()
    ref = Kss - Kzs.T @ torch.linalg.solve(Kzz + noise, Kzs)
    torch.testing.assert_close(var, _per_input(ref, 3, 1))
