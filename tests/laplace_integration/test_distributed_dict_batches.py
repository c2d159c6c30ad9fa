"""Dict-like batches (``DiffFuncGGN``) fitted on three gloo ranks, one shard empty.

The empty rank reads the output size and finds the last layer from a one-sample
dict probe of another rank; every rank's posterior precision, log marginal
likelihood and ``n_data`` must equal one process on all 60 points to 1e-10.
"""

from __future__ import annotations

import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, Dataset

from laplace_diffjac import DiffFuncGGN
from laplace_diffjac.data._ranks import run_on_ranks

from .shards import assert_ranks_equal_reference

N_POINTS = 60
SHARDS = [(0, 35), (35, 35), (35, 60)]
FLAVOURS = [("all", "full"), ("all", "diag"), ("all", "kron"), ("last_layer", "full")]


class DictMLP(nn.Module):
    """A float64 MLP ``3 -> 6 -> 3`` that takes ``{"input_ids": x}``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 3)).double()

    def forward(self, batch: dict) -> torch.Tensor:
        return self.net(batch["input_ids"])


class Points(Dataset):
    """Points ``lo:hi`` of a seeded classification set, as dicts."""

    def __init__(self, lo: int, hi: int) -> None:
        gen = torch.Generator().manual_seed(3)
        self.x = torch.randn(N_POINTS, 3, generator=gen, dtype=torch.float64)[lo:hi]
        self.y = torch.randint(0, 3, (N_POINTS,), generator=gen)[lo:hi]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def _fit_all(loader: DataLoader) -> dict:
    results = {}
    for sow, hs in FLAVOURS:
        la = Laplace(DictMLP(), "classification", sow, hs, backend=DiffFuncGGN)
        la.fit(loader)
        precision = la.posterior_precision
        if hasattr(precision, "to_matrix"):  # KronDecomposed
            precision = precision.to_matrix()
        results[(sow, hs)] = {
            "precision": precision,
            "lml": la.log_marginal_likelihood().detach(),
            "n_data": la.n_data,
        }
    return results


def _fit_shard(rank: int, world: int) -> dict:
    return _fit_all(DataLoader(Points(*SHARDS[rank]), batch_size=10))


def test_dict_batches_on_three_ranks_equal_one_process():
    reference = _fit_all(DataLoader(Points(0, N_POINTS), batch_size=10))
    assert_ranks_equal_reference(run_on_ranks(_fit_shard, 3), reference)
