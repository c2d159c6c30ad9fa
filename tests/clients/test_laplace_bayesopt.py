"""A real client: laplace-bayesopt's ``LaplaceBoTorch`` on this package's backends.

The surrogate trains its network with a seeded loop that does not involve the
backend, so fits with different backends see the same trained network; their
posterior mean and variance must equal those of the client's default backend,
``CurvlinopsGGN``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("laplace_bayesopt")
pytest.importorskip("botorch")

from botorch.acquisition import LogExpectedImprovement  # noqa: E402
from botorch.optim import optimize_acqf  # noqa: E402
from laplace.curvature import CurvlinopsGGN  # noqa: E402
from laplace_bayesopt.botorch import LaplaceBoTorch  # noqa: E402

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN  # noqa: E402

RTOL = 1e-6

#: laplace-torch's ``KronDecomposed.__mul__`` calls ``float()`` on the client's
#: learnable noise scale (``_H_factor``), whichever backend; not this package's.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Converting a tensor with requires_grad=True to a scalar:UserWarning"
)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    X = torch.rand(12, 2, generator=gen, dtype=torch.float64)
    Y = X.sin().sum(-1, keepdim=True) + 0.05 * torch.randn(12, 1, generator=gen)
    return X, Y.double()


def _surrogate(backend: type, structure: str) -> LaplaceBoTorch:
    X, Y = _data()
    torch.manual_seed(1)  # network initialisation and loader shuffling
    return LaplaceBoTorch(
        _net,
        X,
        Y,
        hess_factorization=structure,
        backend=backend,
        n_epochs=20,
        batch_size=6,
        posthoc_marglik_iters=5,
    )


def _query() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.rand(5, 1, 2, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
@pytest.mark.parametrize(
    "backend", [DiffBackPackGGN, DiffFuncGGN], ids=lambda b: b.__name__
)
def test_posterior_equals_default_backend(backend, structure):
    ours, reference = (
        _surrogate(backend, structure),
        _surrogate(CurvlinopsGGN, structure),
    )
    assert ours.bnn._backend_cls is backend
    for p, q in zip(ours.net.parameters(), reference.net.parameters()):
        assert torch.equal(p, q)  # the same trained network
    x = _query()
    post, post_ref = ours.posterior(x), reference.posterior(x)
    torch.testing.assert_close(post.mean, post_ref.mean, rtol=RTOL, atol=1e-10)
    torch.testing.assert_close(post.variance, post_ref.variance, rtol=RTOL, atol=1e-10)
    # Gradients with respect to the query flow through our Jacobians.
    xq = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ours.posterior(xq).variance.sum(), xq)
    xr = x.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(reference.posterior(xr).variance.sum(), xr)
    torch.testing.assert_close(g, g_ref, rtol=RTOL, atol=1e-10)


@pytest.mark.parametrize(
    "backend", [DiffBackPackGGN, DiffFuncGGN], ids=lambda b: b.__name__
)
def test_optimize_acqf_raises_no_warning_from_this_package(backend):
    surrogate = _surrogate(backend, "kron")
    bounds = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acqf = LogExpectedImprovement(surrogate, best_f=surrogate.train_Y.max())
        candidate, value = optimize_acqf(
            acqf, bounds, q=1, num_restarts=2, raw_samples=8, options={"maxiter": 5}
        )
    ours = [w for w in caught if "laplace_diffjac" in (w.filename or "")]
    assert not ours, [str(w.message) for w in ours]
    assert candidate.shape == (1, 2) and torch.isfinite(value).all()
    assert ((candidate >= 0) & (candidate <= 1)).all()
