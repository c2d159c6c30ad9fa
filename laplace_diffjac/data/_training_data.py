"""The one reading of a ``data`` argument: tensors, ``(x, y)`` or a ``DataLoader``.

Every part of the package that takes training data (the location optimiser, the
context posterior, its evidence, ``LocationFunctionalLaplace``) reads it through
:class:`TrainingData`, which answers what they ask: its batches (one at a time,
a loader is never gathered unless asked), all inputs at once, whether it streams,
its size, and the checks it must pass before any work. Under
``torch.distributed`` it is this rank's shard (see :mod:`._shards`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Union

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

from ..errors import InvalidInputError
from ._checks import check_inputs
from ._process_group import is_distributed
from ._shards import check_shard

Data = Union[DataLoader, torch.Tensor, tuple, list]

__all__ = ["Data", "SizedLoader", "TrainingData"]

Batch = tuple[torch.Tensor, Union[torch.Tensor, None]]


class TrainingData:
    """A data argument as the package reads it.

    Parameters
    ----------
    data : DataLoader, torch.Tensor, tuple or TrainingData
        A loader yielding ``(x, y)`` or ``x`` batches (also over an
        ``IterableDataset``), inputs ``(N, *input_shape)``, or ``(x, y)``
        with ``y`` of ``N`` rows or ``None``. A ``TrainingData`` is taken as is.
    batch_size : int, default=256
        Batch size for tensors (a loader keeps its own batches).
    name : str, default='data'
        The argument's name, for error messages.

    Raises
    ------
    InvalidInputError
        For anything else, or ``x`` and ``y`` of different lengths.

    """

    def __init__(
        self, data: Data | TrainingData, batch_size: int = 256, name: str = "data"
    ) -> None:
        raw: Data = data.data if isinstance(data, TrainingData) else data
        _check_kind(raw, name)
        self.data: Data = raw
        self.batch_size = batch_size
        self.name = name

    @property
    def loader(self) -> DataLoader | None:
        """The ``DataLoader``, or ``None`` for tensors."""
        return self.data if isinstance(self.data, DataLoader) else None

    @property
    def is_iterable(self) -> bool:
        """Whether the data is a loader over an ``IterableDataset`` (no indexing)."""
        loader = self.loader
        return loader is not None and isinstance(loader.dataset, IterableDataset)

    def batches(self) -> Iterator[Batch]:
        """``(x, y)`` batches without empty ones; ``y`` is ``None`` without targets.

        One batch at a time: a loader is iterated once, in its own batches.

        Yields
        ------
        tuple of torch.Tensor
            ``(b, *input_shape)`` and ``(b, ...)`` or ``None``.

        """
        for xb, yb in self._all_batches():
            if len(xb) > 0:
                yield xb, yb

    def input_batches(self) -> Iterator[torch.Tensor]:
        """The inputs of :meth:`batches`."""
        for xb, _ in self.batches():
            yield xb

    def gather(
        self, in_order: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All inputs and (if present) targets, concatenated.

        Parameters
        ----------
        in_order : bool, default=False
            Read a shuffling loader (``shuffle=True``, a ``RandomSampler``) in its
            data set's order instead, so that the result does not depend on the
            loader's random state.

        Returns
        -------
        x : torch.Tensor
            ``(N, *input_shape)`` (a loader's empty shard gives ``(0,)``).
        y : torch.Tensor or None
            ``(N, ...)`` targets, or ``None`` if the data has none.

        """
        if isinstance(self.data, torch.Tensor):
            return self.data, None
        loader = self.loader
        if loader is None:
            x, y = self.data
            return x, y
        xs, ys = [], []
        loader = _in_order(loader) if in_order else loader
        for xb, yb in _loader_batches(loader):
            xs.append(xb)
            if yb is not None:
                ys.append(yb)
        x = torch.cat(xs) if xs else torch.empty(0)
        return x, (torch.cat(ys) if ys else None)

    def check(self, dtype: torch.dtype, feature_shape: torch.Size | None) -> None:
        """Checks before any work: all inputs of tensors, a loader's sharding.

        A loader's batches are checked one by one as they are read
        (:meth:`checked_batches`).

        Parameters
        ----------
        dtype : torch.dtype
            The model's dtype.
        feature_shape : torch.Size, optional
            The required ``input_shape`` (that of the locations), if known.

        Raises
        ------
        InvalidInputError
            As :func:`~laplace_diffjac.data.check_inputs` and
            :func:`~laplace_diffjac.data.check_shard`.

        """
        check_shard(self.data, self.name)
        if self.loader is None:
            x, _ = self.gather()
            check_inputs(x, self.name, dtype, feature_shape, is_distributed())

    def checked_batches(
        self, dtype: torch.dtype, feature_shape: torch.Size | None
    ) -> Iterator[Batch]:
        """:meth:`batches`, each input batch checked as it arrives.

        Parameters
        ----------
        dtype : torch.dtype
            The model's dtype.
        feature_shape : torch.Size, optional
            The required ``input_shape``.

        Yields
        ------
        tuple of torch.Tensor
            As :meth:`batches`.

        """
        for xb, yb in self.batches():
            check_inputs(xb, self.name, dtype, feature_shape)
            yield xb, yb

    def size(self, n_data: int | None = None) -> int:
        """``N`` of this rank: ``n_data`` if given, else the data's length.

        Parameters
        ----------
        n_data : int, optional
            The number of points, where the data cannot tell (an
            ``IterableDataset``).

        Returns
        -------
        int

        Raises
        ------
        InvalidInputError
            For an invalid ``n_data``, or a loader whose data set has no length
            when ``n_data`` is not given.

        """
        if n_data is not None:
            if isinstance(n_data, bool) or not isinstance(n_data, int) or n_data < 1:
                raise InvalidInputError(
                    "n_data must be a positive int (the number of training "
                    f"points); got {n_data!r}."
                )
            return n_data
        if self.loader is None:
            return len(self.gather()[0])
        try:
            return len(self.loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidInputError(
                f"{self.name}'s data set has no len() (an IterableDataset), so the "
                "number of training points N is unknown; pass it as n_data=N."
            ) from None

    def as_loader(self) -> DataLoader:
        """The data as a ``DataLoader`` (tensors in batches of ``batch_size``)."""
        if self.loader is not None:
            return self.loader
        x, y = self.gather()
        dataset = TensorDataset(x) if y is None else TensorDataset(x, y)
        return DataLoader(dataset, batch_size=min(len(x), self.batch_size))

    def _all_batches(self) -> Iterator[Batch]:
        if self.loader is not None:
            yield from _loader_batches(self.loader)
            return
        if isinstance(self.data, torch.Tensor):
            for xb in torch.split(self.data, self.batch_size):
                yield xb, None
            return
        x, y = self.data
        if y is None:
            for xb in torch.split(x, self.batch_size):
                yield xb, None
            return
        yield from zip(torch.split(x, self.batch_size), torch.split(y, self.batch_size))


class SizedLoader:
    """A loader as laplace-torch's ``fit`` reads it, with ``len(dataset) = N``.

    laplace-torch reads ``next(iter(loader))``, ``loader.batch_size`` and
    ``len(loader.dataset)``; nothing else of the loader is used.

    Parameters
    ----------
    loader : DataLoader
        The loader.
    n_data : int
        ``N``.

    """

    def __init__(self, loader: DataLoader, n_data: int) -> None:
        self._loader = loader
        self.batch_size = loader.batch_size
        self.dataset = range(n_data)  # a sized stand-in; never indexed

    def __iter__(self) -> Iterator:
        return iter(self._loader)


def _in_order(loader: DataLoader) -> DataLoader:
    """``loader`` without its shuffling, or ``loader`` if it does not shuffle."""
    if not isinstance(loader.sampler, RandomSampler) or loader.batch_size is None:
        return loader
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        shuffle=False,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
    )


def _loader_batches(loader: DataLoader) -> Iterator[Batch]:
    for batch in loader:
        yield _inputs_and_targets(batch)


def _check_kind(data: Any, name: str) -> None:
    if isinstance(data, (DataLoader, torch.Tensor)):
        return
    if isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = data
        if not isinstance(x, torch.Tensor):
            raise InvalidInputError(
                f"{name} must hold an input tensor first; got {type(x).__name__}."
            )
        if y is not None and len(y) != len(x):
            raise InvalidInputError(
                f"{name}: x has {len(x)} rows but y has {len(y)}; pass matching "
                "inputs and targets."
            )
        return
    raise InvalidInputError(
        f"{name} must be a DataLoader, an input tensor or a tuple (x, y); got "
        f"{type(data).__name__}."
    )


def _inputs_and_targets(batch: Any) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    if isinstance(batch, dict):
        raise InvalidInputError(
            "A batch is a dict; the context API takes tensor inputs. Yield "
            "(x, y) tuples of tensors from the loader."
        )
    raise InvalidInputError(f"Unsupported batch type {type(batch).__name__}.")
