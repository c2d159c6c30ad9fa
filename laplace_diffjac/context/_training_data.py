"""Training batches with their targets, and the checks every input batch passes."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from ..errors import InvalidInputError
from ._data import Data, _inputs_and_targets

__all__ = ["check_inputs", "xy_batches"]


def xy_batches(
    data: Data, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Yield ``(x, y)`` batches (``y`` is ``None`` where the data has no targets).

    One batch at a time: a loader (also over an ``IterableDataset``) is never
    gathered. Batches without rows (an empty shard) are skipped.

    Parameters
    ----------
    data : DataLoader, torch.Tensor or tuple
        As :func:`laplace_diffjac.context._data.collect` reads it; a loader is
        iterated once, in its own batches.
    batch_size : int
        Batch size for a tensor or a tuple.

    Yields
    ------
    tuple of torch.Tensor
        ``(b, *input_shape)`` and ``(b, ...)`` or ``None``.

    Raises
    ------
    TypeError
        For anything else.

    """
    for xb, yb in _all_batches(data, batch_size):
        if len(xb) > 0:
            yield xb, yb


def _all_batches(
    data: Data, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    if isinstance(data, DataLoader):
        for batch in data:
            yield _inputs_and_targets(batch)
        return
    if isinstance(data, torch.Tensor):
        for xb in torch.split(data, batch_size):
            yield xb, None
        return
    if isinstance(data, (tuple, list)) and len(data) == 2:
        if data[1] is not None and len(data[1]) != len(data[0]):
            raise InvalidInputError(
                f"x has {len(data[0])} rows but y has {len(data[1])}; pass matching "
                "inputs and targets."
            )
        ys: list[torch.Tensor | None] = [None] * len(range(0, len(data[0]), batch_size))
        if data[1] is not None:
            ys = list(torch.split(data[1], batch_size))
        yield from zip(torch.split(data[0], batch_size), ys)
        return
    raise TypeError(
        "data must be a DataLoader, an input tensor or a tuple (x, y); "
        f"got {type(data).__name__}."
    )


def check_inputs(
    x: torch.Tensor,
    name: str,
    dtype: torch.dtype,
    feature_shape: torch.Size | tuple[int, ...] | None,
    allow_empty: bool = False,
) -> None:
    """Raise before any work if a batch of inputs cannot be used.

    Parameters
    ----------
    x : torch.Tensor
        ``(b, *input_shape)``.
    name : str
        The argument's name, for the message.
    dtype : torch.dtype
        The model's parameter dtype.
    feature_shape : tuple of int, optional
        Required ``input_shape`` (that of the locations), if known.
    allow_empty : bool, default=False
        Accept ``b = 0`` (a rank's empty shard under ``torch.distributed``).

    Raises
    ------
    InvalidInputError
        If ``x`` is not a batched tensor of ``dtype`` with finite entries and the
        required feature shape.

    """
    if (
        not isinstance(x, torch.Tensor)
        or x.dim() < 2
        or (x.shape[0] == 0 and not allow_empty)
    ):
        raise InvalidInputError(
            f"{name} must be a non-empty batched tensor (B, *input_shape); got "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}."
        )
    if x.dtype != dtype:
        raise InvalidInputError(
            f"{name} has dtype {x.dtype} but the model's parameters are {dtype}; "
            f"cast it with .to({dtype})."
        )
    if feature_shape is not None and tuple(x.shape[1:]) != tuple(feature_shape):
        raise InvalidInputError(
            f"{name} has input shape {tuple(x.shape[1:])} but the locations have "
            f"{tuple(feature_shape)}; locations and data must have the same features."
        )
    if not bool(torch.isfinite(x).all()):
        raise InvalidInputError(f"{name} contains NaN or infinite values.")
