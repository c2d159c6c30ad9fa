"""What every method of one (data set, seed) shares: the network and references."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffBackPackGGN

from .data import Split
from .reference import FullReference
from .training import TrainConfig, train_map

__all__ = ["SeedContext", "build_context", "random_subset"]


@dataclass
class SeedContext:
    """The trained network of one seed and what all methods reuse.

    ``jac_val``/``jac_test`` are the Jacobians ``(n, C, P)`` of the validation and
    test inputs, ``f_val``/``f_test`` the MAP outputs ``(n, C)``, ``proj_*`` the
    Jacobians projected on the full posterior's eigenvectors.
    """

    split: Split
    seed: int
    model: torch.nn.Module
    sigma_noise: float
    train_loader: DataLoader
    full: FullReference
    jac_val: torch.Tensor
    jac_test: torch.Tensor
    f_val: torch.Tensor
    f_test: torch.Tensor
    proj_val: torch.Tensor
    proj_test: torch.Tensor
    times: dict[str, float] = field(default_factory=dict)

    @property
    def likelihood(self) -> str:
        """``'regression'`` or ``'classification'``."""
        return self.split.task


def random_subset(n: int, m: int, seed: int) -> torch.Tensor:
    """Indices of ``m`` of ``n`` training points, from a generator of its own.

    Parameters
    ----------
    n, m : int
        Data set and subset size.
    seed : int
        Seed (the optimiser's minibatch stream uses a different one).

    Returns
    -------
    torch.Tensor
        ``(m,)`` int64.

    """
    gen = torch.Generator().manual_seed(10_000 + seed * 101 + m)
    return torch.randperm(n, generator=gen)[:m]


def build_context(split: Split, seed: int, config: TrainConfig) -> SeedContext:
    """Train the MAP network, fit the full GGN Laplace and the test Jacobians.

    Parameters
    ----------
    split : Split
        Data of this seed.
    seed : int
        Seed.
    config : TrainConfig
        MAP training settings.

    Returns
    -------
    SeedContext

    """
    times: dict[str, float] = {}
    start, cpu = time.perf_counter(), time.process_time()
    model = train_map(split, seed, config)
    times["train"] = time.perf_counter() - start
    times["train_cpu"] = time.process_time() - cpu
    sigma = 1.0
    if split.task == "regression":
        with torch.no_grad():
            resid = model(split.x_train) - split.y_train
        sigma = float(resid.pow(2).mean().sqrt())
    loader = DataLoader(
        TensorDataset(split.x_train, split.y_train), batch_size=config.batch_size
    )
    start, cpu = time.perf_counter(), time.process_time()
    full = FullReference(model, split.task, loader, sigma_noise=sigma)
    times["full_fit"] = time.perf_counter() - start
    times["full_fit_cpu"] = time.process_time() - cpu
    times["full_laplace_fit"], times["full_eigh"] = full.fit_s, full.eigh_s
    backend = DiffBackPackGGN(model, split.task)
    jac = {}
    for key, x in (("val", split.x_val), ("test", split.x_test)):
        Js, f = backend.jacobians(x, enable_backprop=False)
        jac[key] = (Js.detach(), f.detach())
    return SeedContext(
        split=split,
        seed=seed,
        model=model,
        sigma_noise=sigma,
        train_loader=loader,
        full=full,
        jac_val=jac["val"][0],
        jac_test=jac["test"][0],
        f_val=jac["val"][1],
        f_test=jac["test"][1],
        proj_val=jac["val"][0].double() @ full.eigenvectors,
        proj_test=jac["test"][0].double() @ full.eigenvectors,
        times=times,
    )
