"""laplace-torch fitted on real gloo process groups equals one process on all data.

Each rank passes its own shard of 120 float64 points (uneven, one empty with four
ranks); every rank's posterior precision, Kronecker factors, log marginal
likelihood, GLM predictive and marglik-tuned prior precision must equal those of
one process fitted on the concatenated shards (a loader of different batches),
to 1e-10. The refusals run on real groups too.
"""

from __future__ import annotations

import copy

import laplace
import pytest
import torch
from laplace import Laplace
from laplace.utils import Kron, LargestMagnitudeSubnetMask
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from laplace_diffjac.data._ranks import run_on_ranks
from tests.conftest import ON_LAPLACE_03

from .helpers import base_model, n_outputs_for, query_inputs
from .shards import (
    BATCH,
    SHARDS,
    N,
)
from .shards import (
    assert_equal as _assert_equal,
)
from .shards import (
    assert_ranks_equal_reference as _assert_ranks_equal_reference,
)
from .shards import (
    dataset as _dataset,
)
from .shards import (
    shard as _shard,
)

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
    if hasattr(precision, "to_matrix"):  # KronDecomposed
        precision = precision.to_matrix()
    result = {
        "precision": precision,
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


# ----------------------------------------------------------------------------
# Samplers, online fits and the validation shards of the grid search.

ONLINE = [(DiffBackPackGGN, "all", hs) for hs in ("full", "diag", "kron")]


def _online_fit(first: DataLoader, second: DataLoader) -> dict:
    results = {}
    for flavour in ONLINE:
        la = _estimator("regression", flavour)
        la.fit(first)
        la.fit(second, override=False)
        results[flavour[2]] = _summary(la)
    return results


def _sampler_and_online(rank: int, world: int) -> dict:
    data = _dataset("regression")
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    by_sampler = _fit_all({"regression": DataLoader(data, BATCH, sampler=sampler)})
    halves = [_dataset("regression", 60, seed) for seed in (3, 4)]
    shards = [DataLoader(_shard(h, [35, 25], rank), batch_size=BATCH) for h in halves]
    return {"sampler": by_sampler, "online": _online_fit(*shards)}


def test_distributed_sampler_and_online_fits_equal_one_process(reference):
    halves = [
        DataLoader(_dataset("regression", 60, s), batch_size=BATCH) for s in (3, 4)
    ]
    online = _online_fit(*halves)
    regression = {k: v for k, v in reference.items() if k[0] == "regression"}
    for rank, results in enumerate(run_on_ranks(_sampler_and_online, 2)):
        _assert_ranks_equal_reference([results["sampler"]], regression)
        for key, expected in online.items():
            for name, value in expected.items():
                _assert_equal(
                    results["online"][key][name], value, f"{rank} {key} {name}"
                )


VAL_SHARDS = [17, 13]
GRID = dict(method="gridsearch", pred_type="glm", link_approx="probit", grid_size=9)


def _gaussian_nll(
    mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Mean Gaussian NLL (up to a constant) of the GLM predictive.

    It depends on the prior precision through the variance, unlike the MSE.
    """
    var = torch.diagonal(var, dim1=-2, dim2=-1) if var.ndim == 3 else var
    return 0.5 * (var.log() + (y - mean) ** 2 / var).sum(-1).mean()


def _categorical_nll(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -probs.gather(-1, y[:, None]).log().mean()


def _gridsearch(train: DataLoader, val: DataLoader, likelihood: str) -> torch.Tensor:
    la = _estimator(likelihood, (DiffBackPackGGN, "all", "kron"))
    la.fit(train)
    nll = _gaussian_nll if likelihood == "regression" else _categorical_nll
    la.optimize_prior_precision(val_loader=val, loss=nll, **GRID)
    return la.prior_precision.detach().clone()


def _gridsearch_on_shards(rank: int, world: int) -> dict:
    chosen = {}
    for lik in ("regression", "classification"):
        train = DataLoader(_shard(_dataset(lik), SHARDS[world], rank), batch_size=BATCH)
        val = _shard(_dataset(lik, sum(VAL_SHARDS), seed=9), VAL_SHARDS, rank)
        chosen[lik] = _gridsearch(train, DataLoader(val, batch_size=5), lik)
    return chosen


def test_gridsearch_on_validation_shards_equals_one_process():
    expected, single = {}, {}
    for lik in ("regression", "classification"):
        train = DataLoader(_dataset(lik), batch_size=24)
        val = _dataset(lik, sum(VAL_SHARDS), seed=9)
        expected[lik] = _gridsearch(train, DataLoader(val, batch_size=5), lik)
        shard = DataLoader(_shard(val, VAL_SHARDS, 0), batch_size=5)
        single[lik] = _gridsearch(train, shard, lik)
    # The check can fail: rank 0's validation shard alone picks another value.
    assert any(not torch.equal(single[k], expected[k]) for k in expected)
    for rank, chosen in enumerate(run_on_ranks(_gridsearch_on_shards, 2)):
        for lik, value in expected.items():
            _assert_equal(chosen[lik], value, f"rank {rank} {lik}")


# ----------------------------------------------------------------------------
# What is refused, on every rank alike, and what is left alone.


def _outcome(call) -> tuple[str, str]:
    try:
        call()
    except Exception as error:  # noqa: BLE001 (the type and message are compared)
        return type(error).__name__, str(error)
    return "ok", ""


def _refusals(rank: int, world: int) -> dict:
    data = _dataset("regression")
    kron = (DiffBackPackGGN, "all", "kron")
    odd = _dataset("regression", N + 1)
    padding = DistributedSampler(odd, num_replicas=world, rank=rank, shuffle=False)
    own = DataLoader(_shard(data, SHARDS[world], rank), batch_size=BATCH)
    dropping = DataLoader(
        _shard(data, SHARDS[world], rank), batch_size=BATCH + 1, drop_last=True
    )
    empty = DataLoader(_shard(data, [0] * world, rank), batch_size=BATCH)

    def ella() -> None:
        from laplace.baselaplace import ELLA  # laplace-torch 0.3 only

        ELLA(base_model(2), "regression", 10, 5, backend=DiffBackPackGGN).fit(own)

    def gridsearch_without_validation_points() -> None:
        la = _estimator("regression", kron)
        la.fit(own)
        la.optimize_prior_precision(
            method="gridsearch", val_loader=empty, pred_type="glm", grid_size=3
        )

    def upstream() -> int:
        from laplace.curvature import CurvlinopsGGN

        la = Laplace(base_model(2), "regression", "all", "diag", backend=CurvlinopsGGN)
        la.fit(own)
        return la.n_data

    return {
        "padding": _outcome(lambda: _estimator("regression", kron).fit(
            DataLoader(odd, BATCH, sampler=padding))),
        "whole data on every rank": _outcome(
            lambda: _estimator("regression", kron).fit(DataLoader(data, BATCH))),
        "drop_last": _outcome(lambda: _estimator("regression", kron).fit(dropping)),
        "all empty": _outcome(lambda: _estimator("regression", kron).fit(empty)),
        "ELLA": _outcome(ella) if ON_LAPLACE_03 else None,
        "marglik_training": _outcome(lambda: laplace.marglik_training(
            base_model(2), own, "regression", "diag", backend=DiffBackPackGGN,
            n_epochs=1)),
        "empty validation": _outcome(gridsearch_without_validation_points),
        "upstream n_data": upstream(),
    }  # fmt: skip


def test_refusals_are_clear_and_the_same_on_every_rank():
    per_rank = run_on_ranks(_refusals, 2)
    # laplace-torch's own backends are left alone: each rank fits its shard.
    assert [r.pop("upstream n_data") for r in per_rank] == SHARDS[2]
    assert per_rank[0] == per_rank[1]
    result = per_rank[0]
    expected = {
        "padding": ("InvalidInputError", "pads 121 points to 122"),
        "whole data on every rank": ("InvalidInputError", "its own shard"),
        "drop_last": ("InvalidInputError", "yielded 66 points but its shard holds 70"),
        "all empty": ("InvalidInputError", "every rank's shard is empty"),
        "ELLA": ("NotImplementedError", "ELLA.fit"),
        "empty validation": ("InvalidInputError", "every rank's validation shard"),
        "marglik_training": ("NotImplementedError", "DistributedDataParallel"),
    }
    if not ON_LAPLACE_03:  # no ELLA in laplace-torch 0.2.3
        assert result.pop("ELLA") is None
        del expected["ELLA"]
    for case, (kind, text) in expected.items():
        assert result[case][0] == kind and text in result[case][1], (case, result[case])


def test_patches_are_reversible():
    from laplace import baselaplace, lllaplace

    import laplace_diffjac

    owners = [
        baselaplace.ParametricLaplace,
        baselaplace.KronLaplace,
        baselaplace.FullLaplace,
        lllaplace.LLLaplace,
    ]
    patched = [vars(cls)["fit"] for cls in owners]
    laplace_diffjac.unregister()
    try:
        originals = [vars(cls)["fit"] for cls in owners]
        assert all(a is not b for a, b in zip(patched, originals))
        assert all(o.__module__.startswith("laplace.") for o in originals)
    finally:
        laplace_diffjac.register()
    assert [vars(cls)["fit"] for cls in owners] != originals
