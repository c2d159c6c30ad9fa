"""FunctionalLaplace and FunctionalLLLaplace on real gloo groups equal one process.

The GP subset is drawn over the concatenated shards (uneven, one empty with four
ranks) and gathered on every rank; the log marginal likelihood, the GP predictive
(mean and variance) and ``n_data`` must equal one process on all 120 points to
1e-10 (float64), for both GGN backends and both likelihoods.
"""

from __future__ import annotations

import pytest
from laplace import Laplace
from torch.utils.data import DataLoader

from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.data._ranks import run_on_ranks

from .helpers import base_model, n_outputs_for, query_inputs
from .shards import BATCH, SHARDS, assert_ranks_equal_reference, dataset, shard

pytestmark = [
    # laplace-torch 0.2.3 FunctionalLaplace warns on every prediction after fit.
    pytest.mark.filterwarnings("ignore:The prior precision has.* changed since fit"),
]

N_SUBSET = 30
GP_FLAVOURS = [
    (backend, sow)
    for backend in (DiffBackPackGGN, DiffFuncGGN)
    for sow in ("all", "last_layer")
]


def _fit_all(loaders: dict[str, DataLoader]) -> dict:
    results = {}
    for likelihood, loader in loaders.items():
        for backend, sow in GP_FLAVOURS:
            la = Laplace(
                base_model(n_outputs_for(likelihood)), likelihood, sow, "gp",
                n_subset=N_SUBSET, backend=backend,
            )  # fmt: skip
            la.fit(loader)
            results[(likelihood, backend.__name__, sow)] = {
                "lml": la.log_marginal_likelihood().detach(),
                "predictive": la._glm_predictive_distribution(query_inputs()),
                "n_data": la.n_data,
            }
    return results


def _fit_shards(rank: int, world: int) -> dict:
    return _fit_all(
        {
            lik: DataLoader(shard(dataset(lik), SHARDS[world], rank), batch_size=BATCH)
            for lik in ("regression", "classification")
        }
    )


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process on all 120 points."""
    return _fit_all(
        {
            lik: DataLoader(dataset(lik), batch_size=BATCH)
            for lik in ("regression", "classification")
        }
    )


def test_gp_on_two_ranks_equals_one_process(reference):
    assert_ranks_equal_reference(run_on_ranks(_fit_shards, 2), reference)


@pytest.mark.slow
def test_gp_on_four_ranks_with_an_empty_shard_equals_one_process(reference):
    assert_ranks_equal_reference(run_on_ranks(_fit_shards, 4), reference)


def test_a_single_shard_gives_another_gp(reference):
    """The comparison can fail: one shard alone draws another subset."""
    loaders = {"regression": DataLoader(shard(dataset("regression"), [70, 50], 0))}
    alone = _fit_all(loaders)[("regression", "DiffBackPackGGN", "all")]
    expected = reference[("regression", "DiffBackPackGGN", "all")]
    assert abs(float(alone["lml"]) - float(expected["lml"])) > 1e-3
