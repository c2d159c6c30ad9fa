"""Shared set-up for the adapter tests: data, paired fits and comparisons.

Every comparison fits laplace-torch twice on *fresh* copies of the same seeded
float64 model: once with our backend, once with laplace-torch's own (upstream
BackPACK leaves hooks and ``output_size`` behind, so the copies are never shared).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from laplace import Laplace
from laplace.curvature import BackPackEF, BackPackGGN
from laplace.utils import Kron
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from tests.conftest import CASES

RTOL = 1e-8
ATOL = 1e-10

#: laplace-torch's own backend computing the same curvature as ours.
UPSTREAM = {
    DiffBackPackGGN: BackPackGGN,
    DiffBackPackEF: BackPackEF,
    DiffFuncGGN: BackPackGGN,
}

#: Backends with a Kronecker-factored curvature (upstream BackPackEF has none).
HAS_KRON = (DiffBackPackGGN, DiffFuncGGN)

LIKELIHOODS = ["regression", "classification"]

_MLP = next(case for case in CASES if case.name.startswith("mlp"))


def base_model(n_outputs: int) -> nn.Module:
    """Seeded float64 MLP ``3 -> 6 -> 5 -> n_outputs`` (``tests.conftest`` case)."""
    return replace(_MLP, n_outputs=n_outputs).model()


def n_outputs_for(likelihood: str) -> int:
    """Two regression outputs (full output covariance), three classes."""
    return 2 if likelihood == "regression" else 3


def train_loader(
    likelihood: str, n: int = 12, batch_size: int = 6, n_outputs: int | None = None
) -> DataLoader:
    """A seeded data set of ``n`` points in two batches."""
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    c = n_outputs_for(likelihood) if n_outputs is None else n_outputs
    if likelihood == "regression":
        y = torch.randn(n, c, generator=gen, dtype=torch.float64)
    else:
        y = torch.randint(0, c, (n,), generator=gen)
    return DataLoader(TensorDataset(X, y), batch_size=batch_size)


def query_inputs(n: int = 4, requires_grad: bool = False) -> torch.Tensor:
    """Seeded test inputs ``(n, 3)``."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    return x.requires_grad_(requires_grad)


@contextmanager
def upstream_quiet() -> Iterator[None]:
    """Silence the warnings laplace-torch's own BackPACK backend emits.

    BackPACK's full backward hooks warn when no input requires grad; that is
    upstream's behaviour under comparison, not ours, so only there it is muted.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", message="Using backward.. with create_graph")
        yield


def fit(
    backend: type | None,
    likelihood: str,
    subset_of_weights: str,
    hessian_structure: str,
    model: nn.Module | None = None,
    loader: DataLoader | None = None,
    **kwargs: object,
):
    """Build with the ``Laplace`` factory on a fresh model copy and fit."""
    model = base_model(n_outputs_for(likelihood)) if model is None else model
    loader = train_loader(likelihood) if loader is None else loader
    la = Laplace(
        copy.deepcopy(model),
        likelihood,
        subset_of_weights=subset_of_weights,
        hessian_structure=hessian_structure,
        backend=backend,
        **kwargs,
    )
    la.fit(loader)
    return la


def fit_pair(backend: type, likelihood: str, sow: str, hs: str, **kwargs: object):
    """``(ours, upstream)`` fitted on fresh copies of the same model and data."""
    ours = fit(backend, likelihood, sow, hs, **kwargs)
    with upstream_quiet():
        theirs = fit(UPSTREAM[backend], likelihood, sow, hs, **kwargs)
    return ours, theirs


def assert_close(actual: object, expected: object, what: str = "") -> None:
    """Tensors, tuples of tensors or ``Kron`` objects equal up to ``RTOL``."""
    if isinstance(expected, Kron):
        assert isinstance(actual, Kron), what
        assert len(actual.kfacs) == len(expected.kfacs), what
        for i, (fa, fe) in enumerate(zip(actual.kfacs, expected.kfacs)):
            assert len(fa) == len(fe), f"{what} block {i}"
            for a, e in zip(fa, fe):
                torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=what)
        return
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), what  # type: ignore[arg-type]
        for a, e in zip(actual, expected):  # type: ignore[call-overload]
            assert_close(a, e, what)
        return
    torch.testing.assert_close(
        torch.as_tensor(actual).detach(),
        torch.as_tensor(expected).detach(),
        rtol=RTOL,
        atol=ATOL,
        msg=lambda m: f"{what}: {m}",
    )


def predictive_results(la, joint: bool = True) -> dict[str, object]:
    """GLM latent (marginal, joint), public GLM call and seeded NN samples."""
    x = query_inputs()
    results = {
        "glm marginal": la._glm_predictive_distribution(x),
        "glm call": la(x, pred_type="glm"),
        "nn samples": la.predictive_samples(
            x, pred_type="nn", n_samples=3, generator=torch.Generator().manual_seed(0)
        ),
    }
    if joint:
        results["glm joint"] = la._glm_predictive_distribution(x, joint=True)
    return results


def assert_same_predictive(ours, theirs, joint: bool = True) -> None:
    """Predictive results of ``ours`` equal those of the upstream fit ``theirs``."""
    actual = predictive_results(ours, joint)
    with upstream_quiet():
        expected = predictive_results(theirs, joint)
    assert actual.keys() == expected.keys()
    for key in expected:
        assert_close(actual[key], expected[key], key)


GGN_BACKENDS = [DiffBackPackGGN, DiffFuncGGN]

backends = pytest.mark.parametrize(
    "backend", [DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN], ids=lambda b: b.__name__
)
ggn_backends = pytest.mark.parametrize(
    "backend", GGN_BACKENDS, ids=lambda b: b.__name__
)
likelihoods = pytest.mark.parametrize("likelihood", LIKELIHOODS)
