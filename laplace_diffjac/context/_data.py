"""The one reading of a ``Data`` argument: a DataLoader, inputs or ``(x, y)``."""

from __future__ import annotations

from typing import Any, Union

import torch
from torch.utils.data import DataLoader

Data = Union[DataLoader, torch.Tensor, tuple, list]

__all__ = ["Data", "collect"]


def collect(data: Data) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inputs and (if present) targets of a data set, concatenated.

    Parameters
    ----------
    data : DataLoader, torch.Tensor or tuple
        A loader yielding ``(x, y)`` or ``x`` batches, a tensor of inputs
        ``(N, *input_shape)``, or a tuple ``(x, y)``.

    Returns
    -------
    x : torch.Tensor
        ``(N, *input_shape)``.
    y : torch.Tensor or None
        ``(N, ...)`` targets, or ``None`` if the data has none.

    Raises
    ------
    TypeError
        For anything else.

    """
    if isinstance(data, torch.Tensor):
        return data, None
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0], data[1]
    if isinstance(data, DataLoader):
        xs, ys = [], []
        for batch in data:
            x, y = _inputs_and_targets(batch)
            xs.append(x)
            if y is not None:
                ys.append(y)
        return torch.cat(xs), (torch.cat(ys) if ys else None)
    raise TypeError(
        "data must be a DataLoader, an input tensor or a tuple (x, y); "
        f"got {type(data).__name__}."
    )


def _inputs_and_targets(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    raise TypeError(f"Unsupported batch type {type(batch).__name__}.")
