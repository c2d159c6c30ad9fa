"""Loaders over an IterableDataset (no len) stream through the context posterior."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from laplace_diffjac.backends import DiffBackPackGGN, as_backend
from laplace_diffjac.context import ContextPosterior, evidence_loss_backward
from laplace_diffjac.errors import InvalidInputError
from laplace_diffjac.laplace_integration import LocationFunctionalLaplace
from tests.conftest import CASES

MLP = CASES[1]


class _Stream(IterableDataset):
    """``(x, y)`` pairs generated on the fly, in chunks; no ``__len__``."""

    def __init__(self, n: int, chunk: int = 7) -> None:
        self.n, self.chunk = n, chunk

    def __iter__(self):
        for start in range(0, self.n, self.chunk):
            x, y = _chunk(start, min(self.chunk, self.n - start))
            yield from zip(x, y)


def _chunk(start, size):
    gen = torch.Generator().manual_seed(1000 + start)
    x = torch.randn((size, 3), generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (size,), generator=gen)


def _tensors(n, chunk=7):
    parts = [_chunk(s, min(chunk, n - s)) for s in range(0, n, chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _posterior(data):
    la = ContextPosterior(
        MLP.model(), "classification", MLP.inputs(4, 2), prior_precision=0.7,
        batch_size=5,
    )  # fmt: skip
    return la.fit(data)


def test_iterable_loader_gives_the_tensor_posterior_and_evidence():
    loader = DataLoader(_Stream(30), batch_size=4)
    with pytest.raises(TypeError):
        len(loader.dataset)
    x, y = _tensors(30)
    streamed, whole = _posterior(loader), _posterior((x, y))
    xs = MLP.inputs(3, 3)
    assert streamed.n_data == whole.n_data == 30
    for a, b in zip(
        streamed._glm_predictive_distribution(xs),
        whole._glm_predictive_distribution(xs),
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(
        streamed.log_marginal_likelihood(), whole.log_marginal_likelihood(),
        rtol=1e-10, atol=0,
    )  # fmt: skip


def test_iterable_loader_in_evidence_loss_backward():
    x, y = _tensors(30)
    results = []
    for data in (DataLoader(_Stream(30), batch_size=4), (x, y)):
        model = MLP.model()
        backend = as_backend(model, "classification", DiffBackPackGGN)
        Z = MLP.inputs(4, 2).requires_grad_()
        prec = torch.tensor(0.7, dtype=torch.float64)
        sigma = torch.tensor(1.0, dtype=torch.float64)
        loss = evidence_loss_backward(backend, Z, data, "classification", prec, sigma)
        results.append((loss, Z.grad))
    for a, b in zip(*results):
        assert float((a - b).norm()) <= 1e-10 * float(b.norm())


def test_location_functional_laplace_needs_n_data_for_an_iterable_loader():
    la = LocationFunctionalLaplace(MLP.model(), "classification", MLP.inputs(4, 2))
    with pytest.raises(InvalidInputError, match="n_data=N"):
        la.fit(DataLoader(_Stream(30), batch_size=4))
    with pytest.raises(InvalidInputError, match="n_data"):
        la.fit(DataLoader(_Stream(30), batch_size=4), n_data=0)


def test_location_functional_laplace_with_n_data_equals_the_sized_loader():
    x, y = _tensors(30)
    xs = MLP.inputs(3, 3)
    outputs = []
    for loader, n_data in (
        (DataLoader(_Stream(30), batch_size=4), 30),
        (DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4), None),
    ):
        la = LocationFunctionalLaplace(
            MLP.model(), "classification", MLP.inputs(4, 2), prior_precision=0.7
        )
        la.fit(loader, n_data=n_data)
        assert la.n_data == 30
        outputs.append(la(xs, pred_type="gp"))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=0)


def test_padding_distributed_sampler_is_refused():
    x, y = _tensors(5)
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)
    la = ContextPosterior(MLP.model(), "classification", MLP.inputs(4, 2))
    with pytest.raises(InvalidInputError, match="pads"):
        la.fit(DataLoader(dataset, sampler=sampler, batch_size=2))
    assert la.n_data == 0


def test_empty_data_is_refused():
    la = ContextPosterior(MLP.model(), "classification", MLP.inputs(4, 2))
    with pytest.raises(InvalidInputError, match="no training points"):
        la.fit(DataLoader(_Stream(0), batch_size=4))
