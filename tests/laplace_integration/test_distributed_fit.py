"""laplace-torch fitted on real gloo process groups equals one process on all data.

Each rank passes its own shard of 120 float64 points (uneven, one empty with four
ranks); every rank's posterior precision, Kronecker factors, log marginal
likelihood, GLM predictive and marglik-tuned prior precision must equal those of
one process fitted on the concatenated shards (a loader of different batches),
to 1e-10. The refusals run on real groups too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import Laplace, marglik_training
from laplace.utils import Kron, LargestMagnitudeSubnetMask
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from tests.distributed import run_on_ranks

from .helpers import base_model, n_outputs_for, query_inputs

N, BATCH = 120, 10
SHARDS = {2: [70, 50], 4: [40, 0, 50, 30]}
TOL = dict(rtol=1e-10, atol=1e-10)

pytestmark = [
    # laplace-torch warns on every classification prior optimisation.
    pytest.mark.filterwarnings("ignore:By default `link_approx` is `probit`"),
    # laplace-torch's Kron scaling calls pow() on a tensor that requires grad
    # during marglik tuning, whatever the backend.
    pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True"),
]

#: (backend, subset_of_weights, hessian_structure): every parametric flavour.
FLAVOURS = [
    (backend, sow, hs)
    for backend in (DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN)
    for sow in ("all", "last_layer", "subnetwork")
    for hs in ("full", "diag", "kron")
    if not (hs == "kron" and (sow == "subnetwork" or backend is DiffBackPackEF))
]


def _dataset(likelihood: str, n: int = N, seed: int = 3) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    c = n_outputs_for(likelihood)
    if likelihood == "regression":
        y = torch.randn(n, c, generator=gen, dtype=torch.float64)
    else:
        y = torch.randint(0, c, (n,), generator=gen)
    return TensorDataset(X, y)


def _shard(dataset: TensorDataset, sizes: list[int], rank: int) -> Subset:
    start = sum(sizes[:rank])
    return Subset(dataset, range(start, start + sizes[rank]))


def _estimator(likelihood: str, flavour: tuple) -> Laplace:
    backend, sow, hs = flavour
    model = base_model(n_outputs_for(likelihood))
    extra = {}
    if sow == "subnetwork":
        extra["subnetwork_indices"] = LargestMagnitudeSubnetMask(
            copy.deepcopy(model), n_params_subnet=12
        ).select()
    return Laplace(model, likelihood, sow, hs, backend=backend, **extra)


def _summary(la: Laplace) -> dict:
    precision = la.posterior_precision
    result = {
        "precision": precision.to_matrix() if hasattr(precision, "to_matrix") else precision,
        "lml": la.log_marginal_likelihood().detach(),
        "predictive": la._glm_predictive_distribution(query_inputs()),
        "n_data": la.n_data,
        "n_outputs": la.n_outputs,
    }
    if isinstance(getattr(la, "H_facs", None), Kron):
        result["factors"] = [f.clone() for fs in la.H_facs.kfacs for f in fs]
    la.optimize_prior_precision(method="marglik", n_steps=20)
    result["tuned prior"] = la.prior_precision.detach().clone()
    result["tuned lml"] = la.log_marginal_likelihood().detach()
    return result


def _fit_all(loaders: dict[str, DataLoader]) -> dict:
    results = {}
    for likelihood, loader in loaders.items():
        for flavour in FLAVOURS:
            la = _estimator(likelihood, flavour)
            la.fit(loader)
            results[(likelihood, flavour[0].__name__, *flavour[1:])] = _summary(la)
    return results


def _fit_shards(rank: int, world: int) -> dict:
    sizes = SHARDS[world]
    return _fit_all(
        {
            lik: DataLoader(_shard(_dataset(lik), sizes, rank), batch_size=BATCH)
            for lik in ("regression", "classification")
        }
    )


def _assert_equal(actual: object, expected: object, what: str) -> None:
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), what  # type: ignore[arg-type]
        for a, e in zip(actual, expected):  # type: ignore[call-overload]
            _assert_equal(a, e, what)
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")
    else:
        assert actual == expected, what


def _assert_ranks_equal_reference(per_rank: list[dict], reference: dict) -> None:
    for rank, results in enumerate(per_rank):
        assert results.keys() == reference.keys()
        for key, expected in reference.items():
            for name, value in expected.items():
                _assert_equal(results[key][name], value, f"rank {rank} {key} {name}")


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process on all 120 points, in batches of 24 (not the ranks' batches)."""
    return _fit_all(
        {
            lik: DataLoader(_dataset(lik), batch_size=24)
            for lik in ("regression", "classification")
        }
    )


def test_two_uneven_ranks_equal_one_process(reference):
    _assert_ranks_equal_reference(run_on_ranks(_fit_shards, 2), reference)


@pytest.mark.slow
def test_four_ranks_with_an_empty_shard_equal_one_process(reference):
    _assert_ranks_equal_reference(run_on_ranks(_fit_shards, 4), reference)


def test_reference_differs_from_a_single_shard(reference):
    """The comparison can fail: one shard alone is a different posterior."""
    alone = _fit_all(
        {
            lik: DataLoader(_shard(_dataset(lik), [70, 50], 0), batch_size=BATCH)
            for lik in ("regression", "classification")
        }
    )
    key = ("regression", "DiffBackPackGGN", "all", "full")
    assert not torch.allclose(alone[key]["precision"], reference[key]["precision"])
    assert alone[key]["n_data"] == 70 and reference[key]["n_data"] == N
