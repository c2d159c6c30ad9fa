"""What the theory of the evidence bound promises, against laplace-torch's evidence.

For nested locations the bound can only grow (``Q`` grows in the Loewner order
and ``log det(I + ΛQ) + tr(Λ(K − Q))`` decreases with it), it stays below
``FullLaplace.log_marginal_likelihood`` and reaches it at ``Z = X``, where its
maximiser in the prior precision is the full-data one. Past the kernel's
numerical rank the bound stays valid: the sums are whitened batch by batch, so
rounding is not amplified by the condition number of ``K_ZZ``.
"""

from __future__ import annotations

import pytest
import torch
from laplace import FullLaplace
from laplace.curvature import BackPackGGN
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac.context import ContextPosterior
from tests.conftest import CASES
from tests.context.helpers import ill_conditioned_problem

pytestmark = pytest.mark.filterwarnings(  # laplace-torch's BackPACK backend's hooks
    "ignore:Full backward hook is firing:UserWarning"
)
MLP = CASES[1]  # mlp-C3, P = 77
GRID = torch.logspace(-1.5, 2, 22, dtype=torch.float64)


def _regression(n: int = 12, seed: int = 3):
    model = MLP.model()
    x = MLP.inputs(n, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        y = model(x) + 0.2 * torch.randn(n, 3, generator=gen, dtype=torch.float64)
    return model, x, y, DataLoader(TensorDataset(x, y), batch_size=7)


def _curve(la, sigma: float) -> torch.Tensor:
    s = torch.tensor(sigma, dtype=torch.float64)
    return torch.stack(
        [la.log_marginal_likelihood(d.reshape(1), s).detach() for d in GRID]
    )


def test_bound_grows_with_nested_locations_and_reaches_full_evidence():
    model, x, _, loader = _regression()  # N C = 36 <= P = 77
    full = FullLaplace(model, "regression", backend=BackPackGGN)  # laplace-torch's
    full.fit(loader)
    exact = _curve(full, 0.3)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    previous = torch.full_like(exact, -torch.inf)
    for m in (2, 4, 7, 10, len(x)):
        cp = ContextPosterior(model, "regression", x[order[:m]], jitter=0.0)
        bound = _curve(cp.fit(loader), 0.3)
        assert (bound >= previous - 1e-8 * bound.abs()).all(), m
        assert (bound <= exact + 1e-8 * exact.abs()).all(), m
        previous = bound
    torch.testing.assert_close(previous, exact, rtol=1e-8, atol=0)
    assert int(previous.argmax()) == int(exact.argmax())


@pytest.mark.parametrize("jitter", [1e-8, 1e-6])
def test_a_valid_bound_past_the_numerical_rank_at_any_jitter(jitter):
    """Sixty locations on a line, far past the NTK's numerical rank: still a bound.

    The whitened sums never amplify rounding by the condition number of ``K_ZZ``,
    so the default jitter gives a finite bound below the full evidence and close
    to it (the unwhitened form lost definiteness here).
    """
    model, x, y, Z = ill_conditioned_problem()
    full = FullLaplace(model, "regression", backend=BackPackGGN, sigma_noise=0.01)
    full.fit(DataLoader(TensorDataset(x, y), batch_size=64))
    cp = ContextPosterior(model, "regression", Z, sigma_noise=0.01, jitter=jitter)
    cp.fit((x, y))
    for d in (0.1, 1.0, 10.0):
        prec = torch.tensor([d], dtype=torch.float64)
        bound = cp.log_marginal_likelihood(prec)
        evidence = full.log_marginal_likelihood(prec)
        assert torch.isfinite(bound)
        assert bound <= evidence + 1e-9 * evidence.abs()
        assert bound >= evidence - 0.05 * evidence.abs()  # and not a vacuous one
