"""Checks on the input batch, run before anything on the model is touched."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..errors import InvalidInputError


def check_tensor_batch(x: object, model: nn.Module, backend: str) -> torch.Tensor:
    """Validate a batch for a backend that takes a single tensor.

    Parameters
    ----------
    x : object
        The batch, expected ``(batch, *input_shape)``.
    model : torch.nn.Module
        Model the batch is fed to; its first parameter fixes device and dtype.
    backend : str
        Backend name used in error messages.

    Returns
    -------
    torch.Tensor
        ``x`` itself.

    Raises
    ------
    InvalidInputError
        For mappings, non-tensors, scalars, empty batches, and a device or
        floating dtype that differs from the model's.

    """
    if isinstance(x, Mapping):
        raise InvalidInputError(
            f"{backend} takes a tensor batch, not a dict-like input "
            f"(keys: {list(x.keys())}). Use laplace_diffjac.DiffFuncGGN, which "
            "supports dict-like inputs through torch.func."
        )
    if not isinstance(x, torch.Tensor):
        raise InvalidInputError(
            f"{backend} expects a torch.Tensor batch, got {type(x).__name__}."
        )
    if x.dim() == 0:
        raise InvalidInputError(
            f"{backend} expects a batch of shape (batch, *input_shape), got a scalar."
        )
    if x.shape[0] == 0:
        raise InvalidInputError(
            f"{backend} got an empty batch (shape {tuple(x.shape)}); pass at least "
            "one input."
        )
    param = next(model.parameters(), None)
    if param is not None:
        if x.device != param.device:
            raise InvalidInputError(
                f"Input is on {x.device} but the model is on {param.device}; move "
                f"it with x.to({str(param.device)!r})."
            )
        if x.is_floating_point() and x.dtype != param.dtype:
            raise InvalidInputError(
                f"Input has dtype {x.dtype} but the model's parameters are "
                f"{param.dtype}; cast it with x.to({param.dtype})."
            )
    return x


def check_mapping_or_tensor_batch(x: object, model: nn.Module, backend: str) -> int:
    """Validate a tensor or dict-like batch and return its batch size.

    Parameters
    ----------
    x : object
        A tensor ``(batch, ...)`` or a mapping whose tensor values share a leading
        batch dimension.
    model : torch.nn.Module
        Model the batch is fed to.
    backend : str
        Backend name used in error messages.

    Returns
    -------
    int
        The batch size.

    """
    if not isinstance(x, Mapping):
        return check_tensor_batch(x, model, backend).shape[0]
    sizes = {v.shape[0] for v in x.values() if isinstance(v, torch.Tensor) and v.dim()}
    if not sizes:
        raise InvalidInputError(f"{backend}: the dict-like input holds no tensors.")
    if len(sizes) != 1:
        raise InvalidInputError(
            f"{backend}: the tensors of the dict-like input disagree on the batch "
            f"size ({sorted(sizes)})."
        )
    (size,) = sizes
    if size == 0:
        raise InvalidInputError(f"{backend} got an empty batch; pass at least one.")
    param = next(model.parameters(), None)
    for key, value in x.items():
        if isinstance(value, torch.Tensor) and param is not None:
            if value.device != param.device:
                raise InvalidInputError(
                    f"Input '{key}' is on {value.device} but the model is on "
                    f"{param.device}."
                )
    return size


def check_model_output(f: object, batch_size: int) -> torch.Tensor:
    """Check that the model returned ``(batch,)`` or ``(batch, outputs)``.

    Parameters
    ----------
    f : object
        What the model returned.
    batch_size : int
        Expected leading dimension.

    Returns
    -------
    torch.Tensor
        ``f`` itself.

    """
    if not isinstance(f, torch.Tensor):
        raise InvalidInputError(
            f"The model returned {type(f).__name__}; a tensor (batch, outputs) is "
            "needed."
        )
    if f.dim() not in (1, 2) or f.shape[0] != batch_size:
        raise InvalidInputError(
            f"The model returned shape {tuple(f.shape)}; Jacobians need outputs "
            f"of shape ({batch_size},) or ({batch_size}, outputs). Flatten extra "
            "output dimensions in the model."
        )
    return f
