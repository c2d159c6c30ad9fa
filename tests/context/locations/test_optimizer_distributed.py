"""optimize_locations on real gloo process groups equals the single-process run.

The shards (uneven, one empty) concatenated in rank order are the data set; the
locations after a fixed number of steps must equal the single-process result on
the concatenation to 1e-10 (float64). Streamed loaders are checked against Adam
run by hand on the public objective ``nystrom_gap`` over the same minibatches.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.context import LocationSettings, nystrom_gap, optimize_locations
from laplace_diffjac.data._ranks import run_on_ranks
from laplace_diffjac.errors import InvalidInputError
from laplace_diffjac.kernels._likelihood_hessians import output_hessians
from tests.conftest import CASES

MLP = CASES[1]  # mlp-C3
N, M, STEPS, BATCH = 23, 4, 8, 7
# (name, init, structured, extra settings)
CONFIGS = [
    ("random", "random", None, {}),
    ("given-jacobians", "given", False, {}),
    ("kmeans-full", "kmeans", None, {"evaluate_full": True}),
    ("early-stop", "random", None, {"patience": 2, "rel_tol": 0.5, "steps": 30}),
]


def _data() -> torch.Tensor:
    return MLP.inputs(N, seed=3)


def _given() -> torch.Tensor:
    return MLP.inputs(M, seed=4)


def _run(data, config, **extra) -> dict:
    _, init, structured, more = config
    options = dict(steps=STEPS, batch_size=BATCH, seed=5, progress_bar=False)
    options.update(more)
    settings = LocationSettings(structured=structured, **options, **extra)
    result = optimize_locations(
        MLP.model(),
        "classification",
        data,
        M,
        init=_given() if init == "given" else init,
        settings=settings,
    )
    h = result.history
    return {
        "Z": result.locations,
        "objective": torch.tensor(h.objective, dtype=torch.float64),
        "full": torch.tensor([h.initial_objective, h.final_objective]),
        "stopped": h.stopped_early,
    }


def _shard(rank: int, sizes: list[int]) -> torch.Tensor:
    lo = sum(sizes[:rank])
    return _data()[lo : lo + sizes[rank]]


def _on_rank(rank: int, world: int, sizes: list[int]) -> dict:
    shard = _shard(rank, sizes)
    out: dict = {"runs": [_run(shard, c) for c in CONFIGS]}
    wrong = _given() + rank  # differs between ranks
    try:
        optimize_locations(MLP.model(), "classification", shard, M, init=wrong)
        out["mismatch"] = ""
    except InvalidInputError as err:
        out["mismatch"] = str(err)
    loader = DataLoader(TensorDataset(shard), batch_size=3, shuffle=False)
    out["stream"] = _run(loader, CONFIGS[1], stream=True, lr=0.05)["Z"]
    sampled = ("random", "random", None, {"steps": 0})
    out["stream_init"] = _run(loader, sampled, stream=True, max_inputs=5)["Z"]
    return out


def _assert_same(run: dict, ref: dict) -> None:
    torch.testing.assert_close(run["Z"], ref["Z"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        run["objective"], ref["objective"], rtol=1e-10, atol=1e-12
    )
    torch.testing.assert_close(
        run["full"], ref["full"], rtol=1e-10, atol=0, equal_nan=True
    )
    assert run["stopped"] == ref["stopped"]


def _streamed_reference(shards: list[torch.Tensor], steps: int) -> torch.Tensor:
    """Adam by hand on nystrom_gap over the union of each rank's t-th batch."""
    model = MLP.model()
    backend = DiffBackPackGGN(model, "classification")
    per_rank = [list(torch.split(s, 3)) for s in shards if len(s)]
    Z = _given().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([Z], lr=0.05)
    for t in range(steps):
        x = torch.cat([batches[t % len(batches)] for batches in per_rank])
        lam = output_hessians(model(x).detach(), "classification")
        gap = nystrom_gap(backend, x, Z, lam, n_data=N, structured=False)
        (Z.grad,) = torch.autograd.grad(gap, Z)
        optimizer.step()
    return Z.detach()


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [[9, 14], [5, 0, 11, 7]], ids=["2", "4-empty"])
def test_distributed_locations_equal_single_process(sizes):
    assert sum(sizes) == N
    results = run_on_ranks(_on_rank, len(sizes), sizes)
    refs = [_run(_data(), c) for c in CONFIGS]
    assert refs[3]["stopped"] and len(refs[3]["objective"]) < 30
    assert torch.isfinite(refs[2]["full"]).all()
    shards = [_shard(r, sizes) for r in range(len(sizes))]
    stream_ref = _streamed_reference(shards, STEPS)
    for result in results:
        for run, ref in zip(result["runs"], refs):
            _assert_same(run, ref)
        assert "init differs between the ranks" in result["mismatch"]
        torch.testing.assert_close(result["stream"], stream_ref, rtol=1e-10, atol=0)
        # A streamed random init is one uniform subset, the same on every rank.
        assert torch.equal(result["stream_init"], results[0]["stream_init"])
        z = result["stream_init"]
        assert all((_data() == row).all(1).any() for row in z)
        assert len({tuple(row.tolist()) for row in z}) == M
