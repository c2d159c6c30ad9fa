"""``ContextBoTorch`` against a dense linearised GP and BoTorch's conventions.

The reference is the DTC posterior of the linearised network written out densely
in float64 from per-sample autograd Jacobians (``tests.references``): prior mean
``f*(x) − J(x) θ*``, kernel ``J Jᵀ / δ``, Gaussian sites ``y`` with variance ``σ²``.
The posterior is a difference of prior terms (``K** − …``, ``m(x) + …``) that
cancel to a few per cent of their size here (``K_ZZ``'s condition number is about
``4·10⁷``), so either side's rounding is measured against the prior terms' scale
(``max |K**|``, ``max |m|``), not the posterior's: the two sides agree to about
``1e-7`` of it (the reference's explicit inverses are the less stable side), and a
wrong term (other locations, a stale sum) moves them by ``1e-3`` or more.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from laplace_diffjac.errors import InvalidInputError
from tests.references import loop_jacobians

botorch = pytest.importorskip("botorch")

from botorch.acquisition import (  # noqa: E402
    LogExpectedImprovement,
    qLogExpectedImprovement,
)
from botorch.acquisition.objective import ScalarizedPosteriorTransform  # noqa: E402
from botorch.models.transforms.input import Normalize  # noqa: E402
from botorch.models.transforms.outcome import Standardize  # noqa: E402
from botorch.optim import optimize_acqf  # noqa: E402
from gpytorch.distributions import MultitaskMultivariateNormal  # noqa: E402

from laplace_diffjac.bayesopt import ContextBoTorch, RetrainSchedule  # noqa: E402

D = 2
BOUNDS = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)


def _factory(outputs: int = 1):
    def get_net() -> nn.Module:
        return nn.Sequential(
            nn.Linear(D, 8),
            nn.Tanh(),
            nn.Linear(8, 8),
            nn.Tanh(),
            nn.Linear(8, outputs),
        ).double()

    return get_net


def _objective(x: torch.Tensor, outputs: int = 1) -> torch.Tensor:
    y = torch.sin(3 * x[:, :1]) + torch.cos(2 * x[:, 1:])
    return torch.cat([y, y * x[:, :1]], dim=1)[:, :outputs]


def _data(n: int, seed: int, outputs: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    X = torch.rand(n, D, generator=torch.Generator().manual_seed(seed)).double()
    return X, _objective(X, outputs)


def _model(locations: str = "random", outputs: int = 1, **options) -> ContextBoTorch:
    X, Y = _data(8, 0, outputs)
    torch.manual_seed(0)
    settings = dict(
        n_epochs=30, n_locations=5, locations=locations, bounds=BOUNDS,
        location_steps=3, n_domain=32, posthoc_marglik_iters=20,
        retrain=RetrainSchedule(every=None, finetune_epochs=0),  # dual updates
        predictive_mean="dual", evidence="exact",
    )  # fmt: skip
    settings.update(options)
    return ContextBoTorch(_factory(outputs), X, Y, **settings)


def _dense_gp(model: ContextBoTorch, x_star: torch.Tensor):
    """Mean ``(B*, K)`` and joint covariance ``(B* K, B* K)`` of the dense DTC GP."""
    post = model.context_posterior
    net, Z = model.net, post.locations
    delta = float(post.prior_precision)
    beta = 1.0 / float(post.sigma_noise) ** 2
    theta = torch.cat([p.detach().flatten() for p in net.parameters()])
    J_x, f_x = loop_jacobians(net, model.train_X)
    J_s, f_s = loop_jacobians(net, x_star)
    J_z, _ = loop_jacobians(net, Z)
    J_x, J_s, J_z = (j.detach().reshape(-1, theta.numel()) for j in (J_x, J_s, J_z))
    prior_x = f_x.detach().flatten() - J_x @ theta
    prior_s = f_s.detach().flatten() - J_s @ theta
    K_zz = J_z @ J_z.T / delta
    K_zz = K_zz + post.jitter * K_zz.diagonal().mean() * torch.eye(len(K_zz))
    K_zx, K_sz, K_ss = J_z @ J_x.T / delta, J_s @ J_z.T / delta, J_s @ J_s.T / delta
    A = K_zz + beta * K_zx @ K_zx.T
    residual = model.train_Y.flatten() - prior_x
    mean = prior_s + K_sz @ torch.linalg.solve(A, beta * K_zx @ residual)
    middle = torch.linalg.inv(K_zz) - torch.linalg.inv(A)
    cov = K_ss - K_sz @ middle @ K_sz.T
    _SCALES.update(mean=float(prior_s.abs().max()), cov=float(K_ss.abs().max()))
    return mean.reshape(len(x_star), -1), cov


_SCALES: dict[str, float] = {}  # of the last reference: its prior terms' sizes


def _close(a: torch.Tensor, b: torch.Tensor, scale: str, rtol: float = 1e-6) -> None:
    """``max |a − b| < rtol · scale`` (``scale``: the prior term's size)."""
    size = max(_SCALES[scale], float(b.abs().max()))
    assert (a.detach() - b).abs().max() < rtol * size


@pytest.mark.parametrize("locations", ["random", "optimised"])
def test_dual_update_equals_dense_linearised_gp(locations):
    model = _model(locations)
    x_new, y_new = _data(3, 5)
    updated = model.condition_on_observations(x_new, y_new)
    assert updated.trainings == 1 and updated.observations_since_training == 3
    x_star = _data(4, 9)[0]
    post = updated.posterior(x_star)  # one q-batch of 4: joint
    mean, cov = _dense_gp(updated, x_star)
    _close(post.mean.squeeze(-1), mean.squeeze(-1), "mean")
    _close(post.distribution.covariance_matrix, cov, "cov")


def test_conditioning_leaves_the_model_as_it_was():
    model = _model()
    x_star = _data(4, 9)[0]
    before = model.posterior(x_star)
    mean, cov = before.mean.detach(), before.distribution.covariance_matrix.detach()
    model.condition_on_observations(*_data(3, 5))
    after = model.posterior(x_star)
    assert torch.equal(after.mean.detach(), mean)
    assert torch.equal(after.distribution.covariance_matrix.detach(), cov)
    assert model.train_X.shape[0] == 8 and model.orig_train_X.shape[0] == 8


@pytest.mark.parametrize("outputs", [1, 2])
@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_batch_shapes_and_joint_covariance(batch, outputs):
    model = _model(outputs=outputs)
    q = 4
    X = torch.rand(*batch, q, D, generator=torch.Generator().manual_seed(2)).double()
    post = model.posterior(X)
    assert post.mean.shape == (*batch, q, outputs)
    assert post.variance.shape == (*batch, q, outputs)
    cov = post.distribution.covariance_matrix
    assert cov.shape == (*batch, q * outputs, q * outputs)
    if outputs > 1:
        assert isinstance(post.distribution, MultitaskMultivariateNormal)
    flat = X.reshape(-1, q, D)
    for i in range(flat.shape[0]):  # each q-batch is its own joint GP
        mean, joint = _dense_gp(model, flat[i])
        _close(post.mean.reshape(-1, q, outputs)[i], mean, "mean")
        _close(cov.reshape(-1, q * outputs, q * outputs)[i], joint, "cov")


def test_outcome_transform_untransforms_mean_and_covariance():
    X, Y = _data(8, 0)
    kwargs = dict(
        n_epochs=30, n_locations=5, locations="random", bounds=BOUNDS,
        posthoc_marglik_iters=20, predictive_mean="dual", evidence="exact",
    )  # fmt: skip
    torch.manual_seed(0)
    model = ContextBoTorch(
        _factory(), X, Y * 10 + 3, outcome_transform=Standardize(m=1), **kwargs
    )
    x_star = _data(4, 9)[0]
    mean, cov = _dense_gp(model, x_star)  # in the standardised space
    std, mu = (Y * 10 + 3).std(), (Y * 10 + 3).mean()
    post = model.posterior(x_star)
    _close(post.mean.squeeze(-1), mean.squeeze(-1) * std + mu, "mean")
    _close(post.distribution.covariance_matrix, cov * std**2, "cov")


def test_output_indices_are_untransformed_with_their_own_statistics():
    model = _model(outputs=2, outcome_transform=Standardize(m=2))
    x_star = _data(3, 9)[0]
    both = model.posterior(x_star)
    second = model.posterior(x_star, output_indices=[1])
    exact = dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        second.mean.detach().squeeze(-1), both.mean.detach()[:, 1], **exact
    )
    torch.testing.assert_close(
        second.variance.detach().squeeze(-1), both.variance.detach()[:, 1], **exact
    )


def test_observation_noise_and_output_indices():
    model = _model(outputs=2)
    x_star = _data(3, 9)[0]
    plain = model.posterior(x_star).distribution.covariance_matrix.detach()
    noisy = model.posterior(x_star, observation_noise=True)
    sigma2 = float(model.context_posterior.sigma_noise) ** 2
    exact = dict(rtol=1e-12, atol=1e-14)  # the same products, selected or shifted
    noisy_cov = noisy.distribution.covariance_matrix.detach()
    torch.testing.assert_close(
        noisy_cov, plain + sigma2 * torch.eye(6, dtype=torch.float64), **exact
    )
    second = model.posterior(x_star, output_indices=[1])
    both = model.posterior(x_star).mean.detach()
    torch.testing.assert_close(second.mean.detach().squeeze(-1), both[:, 1], **exact)
    second_cov = second.distribution.covariance_matrix.detach()
    torch.testing.assert_close(second_cov, plain[1::2, 1::2], **exact)
    assert model.num_outputs == 2 and model.batch_shape == torch.Size([])


def test_gradients_in_X_against_finite_differences():
    model = _model(outputs=2)
    X = torch.rand(2, 3, D, generator=torch.Generator().manual_seed(4)).double()

    def moments(x):
        post = model.posterior(x)
        return post.mean, post.distribution.covariance_matrix

    assert torch.autograd.gradcheck(moments, (X.requires_grad_(),), atol=1e-6)


# When qLogEI's optimiser moves the q points of a batch onto each other, their
# noise-free joint covariance is singular; GPyTorch's Cholesky then adds jitter and
# says so (as for its own GPs). Every other warning, this package's included, fails.
@pytest.mark.filterwarnings(
    "ignore:A not p.d., added jitter:linear_operator.utils.warnings.NumericalWarning"
)
def test_optimize_acqf_loop_with_analytic_and_monte_carlo_acquisitions():
    model = _model(outcome_transform=Standardize(m=1), retrain=RetrainSchedule(every=2))
    X, Y = model.orig_train_X, model.orig_train_Y
    for q in [1, 2, 1]:
        if q == 1:
            acqf = LogExpectedImprovement(model, best_f=Y.max())
        else:
            acqf = qLogExpectedImprovement(model, best_f=Y.max())
        x, value = optimize_acqf(acqf, BOUNDS, q=q, num_restarts=2, raw_samples=16)
        assert x.shape == (q, D) and torch.isfinite(value).all()
        y = _objective(x)
        X, Y = torch.cat([X, x]), torch.cat([Y, y])
        model = model.condition_on_observations(x, y)
    assert model.orig_train_X.shape[0] == 12
    assert model.trainings == 2  # retrained once, at the second update (q = 2)
    assert model.updates_since_training == 1
    assert model.observations_since_training == 1


def test_a_q_batch_counts_once_towards_retraining():
    """``every`` counts updates (BO iterations), not the observations in them."""
    model = _model(retrain=RetrainSchedule(every=2, finetune_epochs=0))
    x_new, y_new = _data(3, 5)
    first = model.condition_on_observations(x_new, y_new)
    assert first.trainings == 1
    assert first.updates_since_training == 1
    assert first.observations_since_training == 3
    second = first.condition_on_observations(x_new[:1], y_new[:1])
    assert second.trainings == 2
    assert second.updates_since_training == second.observations_since_training == 0


def test_retraining_on_evidence_drop():
    schedule = RetrainSchedule(every=None, evidence_drop=0.5, finetune_epochs=0)
    model = _model(retrain=schedule)
    x_far = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    quiet = model.condition_on_observations(x_far, _objective(x_far))
    assert quiet.trainings == 1
    outlier = model.condition_on_observations(x_far, torch.tensor([[40.0]]).double())
    assert outlier.trainings == 2 and outlier.observations_since_training == 0


def test_bad_input_is_refused_with_the_fix():
    X, Y = _data(8, 0)
    with pytest.raises(InvalidInputError, match="observations"):
        ContextBoTorch(_factory(), X, Y.squeeze(-1), n_epochs=1)
    with pytest.raises(InvalidInputError, match="double"):
        ContextBoTorch(lambda: _factory()().float(), X, Y, n_epochs=1)
    with pytest.raises(InvalidInputError, match="device"):
        ContextBoTorch(_factory(), X, Y, n_epochs=1, device="meta")
    with pytest.raises(InvalidInputError, match="locations"):
        ContextBoTorch(_factory(), X, Y, n_epochs=1, locations="kmeans")
    with pytest.raises(InvalidInputError, match="every"):
        RetrainSchedule(every=0)
    model = _model()
    with pytest.raises(NotImplementedError, match="fantas"):
        model.condition_on_observations(X[None, :2], Y[None, :2])
    with pytest.raises(InvalidInputError, match="match"):
        model.condition_on_observations(torch.rand(2, 3).double(), Y[:2])


def test_input_transform_is_applied_at_training_update_and_prediction():
    X, Y = _data(8, 0)
    kwargs = dict(
        n_epochs=30, n_locations=5, locations="random", bounds=BOUNDS,
        posthoc_marglik_iters=20,
        retrain=RetrainSchedule(every=None, finetune_epochs=0),
    )  # fmt: skip
    torch.manual_seed(0)
    plain = ContextBoTorch(_factory(), X, Y, **kwargs)
    scale = torch.tensor([10.0, 4.0], dtype=torch.float64)
    shift = torch.tensor([-3.0, 1.0], dtype=torch.float64)
    to_unit = Normalize(d=D, bounds=torch.stack([shift, shift + scale]))
    torch.manual_seed(0)
    moved = ContextBoTorch(
        _factory(), X * scale + shift, Y, input_transform=to_unit, **kwargs
    )
    x_new, y_new = _data(2, 5)
    plain = plain.condition_on_observations(x_new, y_new)
    moved = moved.condition_on_observations(x_new * scale + shift, y_new)
    x_star = _data(4, 9)[0]
    ours, theirs = plain.posterior(x_star), moved.posterior(x_star * scale + shift)
    tol = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(theirs.mean.detach(), ours.mean.detach(), **tol)
    torch.testing.assert_close(
        theirs.distribution.covariance_matrix.detach(),
        ours.distribution.covariance_matrix.detach(),
        **tol,
    )


def test_a_given_noise_variance_is_kept_and_only_delta_is_tuned():
    model = _model(noise_var=0.04)
    post = model.context_posterior
    assert float(post.sigma_noise) == pytest.approx(0.2, rel=1e-12)
    assert float(post.prior_precision) != 1.0  # δ was tuned from its start, 1
    updated = model.condition_on_observations(*_data(2, 5))
    assert float(updated.context_posterior.sigma_noise) == pytest.approx(0.2)


def test_posterior_transform_is_applied_last():
    model = _model(outputs=2, outcome_transform=Standardize(m=2))
    x_star = _data(3, 9)[0]
    weights = torch.tensor([0.3, -2.0], dtype=torch.float64)
    both = model.posterior(x_star)
    scalar = model.posterior(
        x_star, posterior_transform=ScalarizedPosteriorTransform(weights)
    )
    cov = both.distribution.covariance_matrix.detach()  # (3·2)², input-major
    W = torch.block_diag(*[weights[None]] * 3)  # (3, 6)
    exact = dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        scalar.mean.detach().squeeze(-1), both.mean.detach() @ weights, **exact
    )
    torch.testing.assert_close(
        scalar.distribution.covariance_matrix.detach(), W @ cov @ W.T, **exact
    )


def _exact_gp(model: ContextBoTorch, x_star: torch.Tensor):
    """The exact GP's corrections to the prior on all observations (K = 1).

    No locations: the mean's ``K*x (Kxx + σ² I)⁻¹ (y − m(X))`` and the
    covariance's ``K*x (Kxx + σ² I)⁻¹ Kx*``, the linearised network's GP
    posterior that the DTC posterior equals when the locations contain the
    observations. Returns the prior mean ``m(x*)`` and covariance ``K**`` too.
    """
    post = model.context_posterior
    net = model.net
    delta, sigma2 = float(post.prior_precision), float(post.sigma_noise) ** 2
    theta = torch.cat([p.detach().flatten() for p in net.parameters()])
    J_x, f_x = loop_jacobians(net, model.train_X)
    J_s, f_s = loop_jacobians(net, x_star)
    J_x, J_s = (j.detach().reshape(-1, theta.numel()) for j in (J_x, J_s))
    prior_x = f_x.detach().flatten() - J_x @ theta
    prior_s = f_s.detach().flatten() - J_s @ theta
    K_xx, K_sx, K_ss = J_x @ J_x.T / delta, J_s @ J_x.T / delta, J_s @ J_s.T / delta
    A = K_xx + sigma2 * torch.eye(len(K_xx), dtype=K_xx.dtype)
    shift = K_sx @ torch.linalg.solve(A, model.train_Y.flatten() - prior_x)
    reduction = K_sx @ torch.linalg.solve(A, K_sx.T)
    return prior_s, shift, K_ss, reduction


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b).abs().max() / b.abs().max())


def _exact_gp_errors(model: ContextBoTorch, x_star: torch.Tensor):
    """Relative errors of the predicted mean shift and covariance reduction.

    Against :func:`_exact_gp` (the linearised network's GP on all observations,
    dual mean), each relative to the reference term's largest entry.
    """
    predicted = model.posterior(x_star)
    prior_mean, shift, prior_cov, reduction = _exact_gp(model, x_star)
    return (
        _relative_error(predicted.mean.squeeze(-1) - prior_mean, shift),
        _relative_error(prior_cov - predicted.distribution.covariance_matrix,
                        reduction),
    )  # fmt: skip


@pytest.mark.parametrize("locations", ["observations", "random"])
def test_observations_as_locations_give_the_exact_gp_after_every_update(locations):
    model = _model(locations, n_locations=12 if locations == "observations" else 4)
    post = model.context_posterior
    if locations == "observations":
        assert torch.equal(post.locations, model.train_X)  # N = 8 <= 12
    hyper = (float(post.prior_precision), float(post.sigma_noise))
    x_star = _data(4, 9)[0]
    for step in range(2):  # 8 -> 10 -> 12 observations
        model = model.condition_on_observations(*_data(2, 5 + step))
        post = model.context_posterior
        assert (float(post.prior_precision), float(post.sigma_noise)) == hyper
        assert model.trainings == 1
        errors = _exact_gp_errors(model, x_star)
        if locations == "observations":
            assert torch.equal(post.locations, model.train_X)
            # Exact up to the jitter of K_ZZ (1e-8 of its mean diagonal).
            assert max(errors) < 1e-4, errors
        else:  # the reference can tell 4 random locations from exact: the mean
            # misses by about 2e-2 (the covariance of this small network's
            # kernel, nearly of rank 4 on these points, only by about 1e-5)
            assert errors[0] > 1e-3, errors


def test_observations_as_locations_become_dual_updates_past_n_locations():
    model = _model("observations", n_locations=9)  # N = 8
    updated = model.condition_on_observations(*_data(3, 5))  # N = 11 > 9
    post = updated.context_posterior
    assert torch.equal(post.locations, model.train_X)  # those of the last fit
    x_star = _data(4, 9)[0]
    mean, cov = _dense_gp(updated, x_star)
    predicted = updated.posterior(x_star)
    # The 8 observations as locations: K_ZZ's condition number is about 3e10
    # (random locations: 4e7).
    _close(predicted.mean.squeeze(-1), mean.squeeze(-1), "mean", rtol=1e-5)
    _close(predicted.distribution.covariance_matrix, cov, "cov", rtol=1e-5)


def test_finetuning_moves_a_copy_of_the_network_and_refits():
    model = _model(retrain=RetrainSchedule(every=None, finetune_epochs=20))
    before = [p.detach().clone() for p in model.net.parameters()]
    updated = model.condition_on_observations(*_data(3, 5))
    assert updated.trainings == 1 and updated.observations_since_training == 3
    assert all(torch.equal(p, q) for p, q in zip(model.net.parameters(), before))
    assert updated.net is not model.net
    assert not all(torch.equal(p, q) for p, q in zip(updated.net.parameters(), before))
    assert not any(p.grad is not None for p in updated.net.parameters())
    old, new = model.context_posterior, updated.context_posterior
    assert float(new.prior_precision) == float(old.prior_precision)
    assert float(new.sigma_noise) == float(old.sigma_noise)
    x_star = _data(4, 9)[0]
    mean, cov = _dense_gp(updated, x_star)  # on the fine-tuned network
    predicted = updated.posterior(x_star)
    _close(predicted.mean.squeeze(-1), mean.squeeze(-1), "mean")
    _close(predicted.distribution.covariance_matrix, cov, "cov")
    # Fine-tuning lowers the training loss on all 11 observations.
    X, Y = updated.train_X, updated.train_Y
    with torch.no_grad():
        loss_before = ((model.net(X) - Y) ** 2).mean()
        loss_after = ((updated.net(X) - Y) ** 2).mean()
    assert loss_after < loss_before


def test_network_mean_is_the_network_output():
    model = _model(predictive_mean="network", outcome_transform=Standardize(m=1))
    x_star = _data(4, 9)[0]
    transform = model.outcome_transform
    with torch.no_grad():
        expected, _ = transform.untransform(model.net(x_star))
    predicted = model.posterior(x_star).mean.detach()
    torch.testing.assert_close(predicted, expected, rtol=1e-10, atol=1e-12)


def test_bad_variant_settings_are_refused():
    X, Y = _data(8, 0)
    with pytest.raises(InvalidInputError, match="predictive_mean"):
        ContextBoTorch(_factory(), X, Y, n_epochs=1, predictive_mean="median")
    with pytest.raises(InvalidInputError, match="finetune_epochs"):
        RetrainSchedule(finetune_epochs=-1)


def test_defaults_are_laplace_bayesopts_mean_and_hyperparameters_exactly():
    """Observations as locations, fine-tuning, the network mean, KFAC's δ and σ."""
    X, Y = _data(8, 0)
    torch.manual_seed(0)
    model = ContextBoTorch(_factory(), X, Y, n_epochs=30, posthoc_marglik_iters=5)
    assert torch.equal(model.context_posterior.locations, model.train_X)
    delta, sigma = _laplace_bayesopt_hyperparameters(
        model.net, model.train_X, model.train_Y, 5
    )
    post = model.context_posterior
    assert float(post.prior_precision) == pytest.approx(delta, rel=1e-8)
    assert float(post.sigma_noise) == pytest.approx(sigma, rel=1e-8)
    updated = model.condition_on_observations(*_data(2, 5))
    assert torch.equal(updated.context_posterior.locations, updated.train_X)
    assert updated.trainings == 1 and updated.net is not model.net
    x_star = _data(4, 9)[0]
    with torch.no_grad():
        network = updated.net(x_star)
    torch.testing.assert_close(
        updated.posterior(x_star).mean.detach(), network, rtol=1e-12, atol=1e-12
    )
    _, _, prior_cov, reduction = _exact_gp(updated, x_star)
    predicted = updated.posterior(x_star).distribution.covariance_matrix
    assert _relative_error(prior_cov - predicted, reduction) < 1e-4


def test_defaults_predict_from_the_linear_layers_after_every_fit():
    """The default MLP and scalar ``δ`` take the Linear layers' route, refit or not."""
    X, Y = _data(8, 0)
    torch.manual_seed(0)
    model = ContextBoTorch(_factory(), X, Y, n_epochs=30, posthoc_marglik_iters=5)
    assert model.context_posterior._linear is not None
    updated = model.condition_on_observations(*_data(2, 5))
    assert updated.context_posterior._linear is not None


def test_residual_mean_is_the_network_plus_the_exact_gp_of_its_residuals():
    X, Y = _data(8, 0)
    torch.manual_seed(0)
    model = ContextBoTorch(
        _factory(), X, Y, n_epochs=30, posthoc_marglik_iters=5,
        predictive_mean="residual",
        retrain=RetrainSchedule(every=None, finetune_epochs=0),
    )  # fmt: skip
    model = model.condition_on_observations(*_data(2, 5))
    post, net = model.context_posterior, model.net
    delta, sigma2 = float(post.prior_precision), float(post.sigma_noise) ** 2
    x_star = _data(4, 9)[0]
    P = sum(p.numel() for p in net.parameters())
    J_x, f_x = loop_jacobians(net, model.train_X)
    J_s, f_s = loop_jacobians(net, x_star)
    J_x, J_s = J_x.detach().reshape(-1, P), J_s.detach().reshape(-1, P)
    K_xx, K_sx = J_x @ J_x.T / delta, J_s @ J_x.T / delta
    A = K_xx + sigma2 * torch.eye(len(K_xx), dtype=K_xx.dtype)
    residual = model.train_Y.flatten() - f_x.detach().flatten()
    shift = K_sx @ torch.linalg.solve(A, residual)
    predicted = model.posterior(x_star).mean.detach().squeeze(-1)
    error = (predicted - f_s.detach().flatten() - shift).abs().max()
    assert error < 1e-4 * shift.abs().max()  # exact up to the jitter of K_ZZ
    # The dual mean with the prior at zero, on the same network, is another
    # function here: the reference can tell them apart.
    torch.manual_seed(0)
    dual = ContextBoTorch(
        _factory(), X, Y, n_epochs=30, posthoc_marglik_iters=5,
        predictive_mean="dual", retrain=RetrainSchedule(every=None, finetune_epochs=0),
    ).condition_on_observations(*_data(2, 5))  # fmt: skip
    assert all(
        torch.equal(p, q) for p, q in zip(dual.net.parameters(), net.parameters())
    )
    other = dual.posterior(x_star).mean.detach().squeeze(-1)
    assert (
        other - f_s.detach().flatten() - shift
    ).abs().max() > 1e-2 * shift.abs().max()


def test_residual_noise_is_the_networks_mean_squared_residual():
    model = _model(noise_var="residuals")
    post = model.context_posterior
    with torch.no_grad():
        mse = ((model.net(model.train_X) - model.train_Y) ** 2).mean()
    assert float(post.sigma_noise) ** 2 == pytest.approx(float(mse), rel=1e-12)
    assert float(post.prior_precision) != 1.0  # δ was tuned from its start, 1
    with pytest.raises(InvalidInputError, match="residuals"):
        _model(noise_var="median")


def _laplace_bayesopt_hyperparameters(net: nn.Module, X, Y, iters: int, sigma=None):
    """laplace-bayesopt's post-hoc tuning, on laplace-torch's own BackPACK backend.

    ``LaplaceBoTorch._train_model``: a ``KronLaplace`` of all the weights
    (``subset_of_weights='all'`` for its default ``last_layer=False``) fitted on
    minibatches of 10, then Adam (lr 0.1) on ``log δ`` and ``log σ`` from 1
    (``σ`` fixed if given).
    """
    import copy
    import warnings

    from laplace import Laplace
    from laplace.curvature import BackPackGGN
    from torch.utils.data import DataLoader, TensorDataset

    net = copy.deepcopy(net)
    la = Laplace(
        net, "regression", subset_of_weights="all", hessian_structure="kron",
        backend=BackPackGGN,
    )  # fmt: skip
    with warnings.catch_warnings():  # BackPACK's full backward hooks warn
        warnings.simplefilter("ignore", UserWarning)
        la.fit(DataLoader(TensorDataset(X, Y), batch_size=10))
    assert la.n_params == sum(p.numel() for p in net.parameters())  # all weights
    log_prior = torch.ones(1, dtype=X.dtype, requires_grad=True)
    log_sigma = torch.ones(1, dtype=X.dtype, requires_grad=sigma is None)
    if sigma is not None:
        log_sigma.data.fill_(math.log(sigma))
    optimizer = torch.optim.Adam(
        [log_prior, log_sigma] if sigma is None else [log_prior], lr=0.1
    )
    for _ in range(iters):
        optimizer.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            loss = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        loss.backward()
        optimizer.step()
    return float(log_prior.detach().exp()), float(log_sigma.detach().exp())


@pytest.mark.parametrize("noise_var", [None, 0.04])
def test_kron_evidence_tunes_as_laplace_bayesopt(noise_var):
    X, Y = _data(8, 0)
    torch.manual_seed(0)
    model = ContextBoTorch(
        _factory(), X, Y, n_epochs=30, posthoc_marglik_iters=30, evidence="kron",
        noise_var=noise_var, predictive_mean="dual",
    )  # fmt: skip
    before = {k: v.clone() for k, v in model.net.state_dict().items()}
    sigma = None if noise_var is None else noise_var**0.5
    delta, sigma = _laplace_bayesopt_hyperparameters(
        model.net, model.train_X, model.train_Y, 30, sigma
    )
    post = model.context_posterior
    assert float(post.prior_precision) == pytest.approx(delta, rel=1e-8)
    assert float(post.sigma_noise) == pytest.approx(sigma, rel=1e-8)
    assert delta != pytest.approx(torch.e, rel=1e-3)  # δ moved from its start
    # The posterior is the exact GP of the linearised network with those values.
    x_star = _data(4, 9)[0]
    errors = _exact_gp_errors(model, x_star)
    assert max(errors) < 1e-4, errors
    for name, value in model.net.state_dict().items():
        assert torch.equal(value, before[name])


def test_kron_evidence_refits_between_trainings_with_its_values():
    X, Y = _data(8, 0)
    torch.manual_seed(0)
    model = ContextBoTorch(
        _factory(), X, Y, n_epochs=30, posthoc_marglik_iters=10, evidence="kron"
    )
    updated = model.condition_on_observations(*_data(2, 5))
    old, new = model.context_posterior, updated.context_posterior
    assert torch.equal(new.prior_precision, old.prior_precision)
    assert torch.equal(new.sigma_noise, old.sigma_noise)
    with pytest.raises(InvalidInputError, match="evidence"):
        ContextBoTorch(_factory(), X, Y, n_epochs=1, evidence="kfac")


@pytest.mark.parametrize("statistics", ["training", "initial"])
def test_outcome_statistics_of_each_training_or_of_the_initial_data(statistics):
    X, Y = _data(8, 0)
    torch.manual_seed(0)
    model = ContextBoTorch(
        _factory(), X, Y * 10 + 3, outcome_transform=Standardize(m=1), n_epochs=5,
        posthoc_marglik_iters=2, retrain=RetrainSchedule(every=1, finetune_epochs=0),
        outcome_statistics=statistics,
    )  # fmt: skip
    x_new, y_new = _data(2, 5)
    retrained = model.condition_on_observations(x_new, y_new * 100)
    assert retrained.trainings == 2
    all_Y = torch.cat([Y * 10 + 3, y_new * 100])
    expected = (Y * 10 + 3) if statistics == "initial" else all_Y
    transform = retrained.outcome_transform
    torch.testing.assert_close(transform.means.squeeze(), expected.mean())
    torch.testing.assert_close(transform.stdvs.squeeze(), expected.std())
    torch.testing.assert_close(
        retrained.train_Y, (all_Y - expected.mean()) / expected.std()
    )
    with pytest.raises(InvalidInputError, match="outcome_statistics"):
        ContextBoTorch(_factory(), X, Y, n_epochs=1, outcome_statistics="running")
