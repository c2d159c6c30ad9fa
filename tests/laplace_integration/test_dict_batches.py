"""Dict-like batches reach the DiffBackPack backends through laplace-torch's ``fit``.

``ParametricLaplace.fit`` refuses a dict-like first batch for backends whose class
name contains "backpack"; the adapter lets ours past (they take such batches), and
afterwards the estimator and its backend hold exactly the class the user chose,
also after an exception. Unregistered, laplace-torch's refusal is back.
"""

from __future__ import annotations

import pytest
import torch
from laplace import Laplace
from torch.utils.data import DataLoader
from transformers import BatchEncoding

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN
from laplace_diffjac.laplace_integration._registration import register, unregister
from tests.class_models import built
from tests.references import loop_jacobians


def _loader(x, y, batch: int = 3) -> DataLoader:
    """Batches as Hugging Face's loaders give them: one ``BatchEncoding`` holding
    the inputs and the ``labels`` (laplace-torch's ``dict_key_y``)."""
    rows = [{**{k: v[i] for k, v in x.items()}, "labels": y[i]} for i in range(len(y))]

    def collate(items):
        return BatchEncoding(
            {k: torch.stack([it[k] for it in items]) for k in items[0]}
        )

    return DataLoader(rows, batch_size=batch, collate_fn=collate)


def _data():
    model, x = built("dict-inputs", 6)
    y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(1))
    return model, x, y


@pytest.mark.parametrize("backend", [DiffBackPackGGN, DiffBackPackEF])
@pytest.mark.parametrize("structure", ["diag", "full"])
def test_fit_on_dict_batches_keeps_the_chosen_class(backend, structure):
    model, x, y = _data()
    la = Laplace(model, "classification", "all", structure, backend=backend)
    la.fit(_loader(x, y))
    assert la._backend_cls is backend
    assert type(la.backend) is backend
    if backend is DiffBackPackGGN:
        J, f = loop_jacobians(model, x)
        p = torch.softmax(f, -1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        H = torch.einsum("bcp,bck,bkq->pq", J, lam, J).detach()
        expected = H if structure == "full" else H.diagonal()
        torch.testing.assert_close(la.H, expected, rtol=1e-10, atol=1e-13)


def test_an_exception_in_fit_restores_the_chosen_class():
    model, x, y = _data()
    la = Laplace(
        model, "classification", hessian_structure="diag", backend=DiffBackPackGGN
    )
    with pytest.raises(Exception):  # noqa: B017 - any failure of the loss
        la.fit(_loader(x, y.float()[:, None].expand(-1, 5)))
    assert la._backend_cls is DiffBackPackGGN
    assert la._backend is None or type(la._backend) is DiffBackPackGGN


def test_unregistered_laplace_refuses_dict_batches_again():
    model, x, y = _data()
    unregister()
    try:
        la = Laplace(model, "classification", "all", "diag", backend=DiffBackPackGGN)
        with pytest.raises(ValueError, match="BackPACK backend"):
            la.fit(_loader(x, y))
    finally:
        register()
