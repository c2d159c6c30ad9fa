"""The training loader as laplace-torch's ``FunctionalLaplace.fit`` reads it.

laplace-torch reads ``next(iter(loader))`` (the output size),
``loader.batch_size`` and ``N = len(loader.dataset)``; a loader over an
``IterableDataset`` has no such ``len``, so ``N`` can be given explicitly.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DataLoader, TensorDataset

from ..errors import InvalidInputError
from ._data import Data, collect

__all__ = ["SizedLoader", "as_loader", "data_size"]


def data_size(loader: DataLoader, n_data: int | None) -> int:
    """``N``: ``n_data`` if given, else ``len(loader.dataset)``."""
    if n_data is not None:
        if isinstance(n_data, bool) or not isinstance(n_data, int) or n_data < 1:
            raise InvalidInputError(
                f"n_data must be a positive int (the number of training points); "
                f"got {n_data!r}."
            )
        return n_data
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInputError(
            "train_loader's data set has no len() (an IterableDataset), so the "
            "number of training points N is unknown; pass it: "
            "fit(train_loader, n_data=N)."
        ) from None


class SizedLoader:
    """``loader`` as laplace-torch's ``fit`` reads it, with ``len(dataset) = N``.

    laplace-torch reads ``next(iter(loader))``, ``loader.batch_size`` and
    ``len(loader.dataset)``; nothing else of the loader is used.
    """

    def __init__(self, loader: DataLoader, n_data: int) -> None:
        self._loader = loader
        self.batch_size = loader.batch_size
        self.dataset = range(n_data)  # a sized stand-in; never indexed

    def __iter__(self) -> Iterator:
        return iter(self._loader)


def as_loader(data: Data) -> DataLoader:
    """A loader for laplace-torch's ``fit`` from any ``Data`` (see ``_data``)."""
    if isinstance(data, DataLoader):
        return data
    x, y = collect(data)
    dataset = TensorDataset(x) if y is None else TensorDataset(x, y)
    return DataLoader(dataset, batch_size=min(len(x), 256), shuffle=False)
