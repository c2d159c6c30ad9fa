"""Checks on the input batch, run before anything on the model is touched."""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping

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
    _check_device_and_dtype(x, model, "Input", "x")
    _check_against_first_linear(x, model, backend)
    return x


def _first_leaf(model: nn.Module) -> nn.Module | None:
    """The first module a (nested) ``nn.Sequential`` calls; ``None`` otherwise.

    Only a ``Sequential`` fixes which module receives the input; a class may
    register its layers in any order.

    Returns
    -------
    torch.nn.Module or None
        The first leaf, or ``None`` for an empty ``Sequential``.

    """
    while isinstance(model, nn.Sequential):
        if len(model) == 0:
            return None
        model = model[0]
    return model


def _check_against_first_linear(
    x: torch.Tensor, model: nn.Module, backend: str
) -> None:
    """Refuse inputs that a ``Sequential``'s first ``Linear`` cannot take.

    PyTorch's own messages (``mat1 and mat2 ...``) name neither the argument nor
    the fix, and come only once the model runs.

    Raises
    ------
    InvalidInputError
        For an integer or boolean ``x``, an unbatched 1-D ``x``, or a last
        dimension other than the layer's ``in_features``.

    """
    if not isinstance(model, nn.Sequential):
        return
    first = _first_leaf(model)
    if type(first) is not nn.Linear:
        return
    dtype = first.weight.dtype
    if not (x.is_floating_point() or x.is_complex()):
        raise InvalidInputError(
            f"{backend}: x is a {x.dtype} tensor, but the model's first layer is "
            f"{first!r}, which takes floating inputs; pass x.to({dtype}) (or put "
            "an nn.Embedding first for token ids)."
        )
    if x.dim() == 1:
        raise InvalidInputError(
            f"{backend}: x has shape {tuple(x.shape)}, one dimension: an unbatched "
            f"input. The first layer, {first!r}, needs (batch, {first.in_features}); "
            f"pass x[None] for one sample, or x[:, None] for {x.shape[0]} samples "
            "of one feature."
        )
    if x.shape[-1] != first.in_features:
        raise InvalidInputError(
            f"{backend}: x has shape {tuple(x.shape)}, but the first layer, "
            f"{first!r}, needs its last dimension to be {first.in_features}."
        )


def check_mapping_or_tensor_batch(x: object, model: nn.Module, backend: str) -> int:
    """Validate a tensor or dict-like batch and return its batch size.

    Parameters
    ----------
    x : object
        A tensor ``(batch, ...)`` or a mapping (``dict``, ``collections.UserDict``
        such as Hugging Face's ``BatchEncoding``) whose tensor values share a
        leading batch dimension; non-tensor values are passed through unchecked.
    model : torch.nn.Module
        Model the batch is fed to; its first parameter fixes device and dtype.
    backend : str
        Backend name used in error messages.

    Returns
    -------
    int
        The batch size.

    Raises
    ------
    InvalidInputError
        For a mapping without tensors, tensors that disagree on the batch size,
        scalars, an empty batch, and a tensor whose device or floating dtype
        differs from the model's.

    """
    if not isinstance(x, Mapping):
        return check_tensor_batch(x, model, backend).shape[0]
    tensors = {k: v for k, v in x.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise InvalidInputError(f"{backend}: the dict-like input holds no tensors.")
    scalars = [k for k, v in tensors.items() if v.dim() == 0]
    if scalars:
        raise InvalidInputError(
            f"{backend}: input(s) {scalars} of the dict-like input are scalars; "
            "every tensor needs a leading batch dimension."
        )
    sizes = {v.shape[0] for v in tensors.values()}
    if len(sizes) != 1:
        raise InvalidInputError(
            f"{backend}: the tensors of the dict-like input disagree on the batch "
            f"size ({sorted(sizes)})."
        )
    (size,) = sizes
    if size == 0:
        raise InvalidInputError(f"{backend} got an empty batch; pass at least one.")
    for key, value in tensors.items():
        _check_device_and_dtype(value, model, f"Input {key!r}", f"x[{key!r}]")
    return size


def batch_size(x: torch.Tensor | Mapping) -> int:
    """Leading dimension of a checked tensor batch or of the tensors of a mapping.

    Parameters
    ----------
    x : torch.Tensor or Mapping
        A batch already validated by :func:`check_mapping_or_tensor_batch`.

    Returns
    -------
    int

    """
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    return next(v for v in x.values() if isinstance(v, torch.Tensor)).shape[0]


def detached(x: torch.Tensor | Mapping) -> torch.Tensor | Mapping:
    """The batch with every tensor detached; a mapping keeps its type.

    Parameters
    ----------
    x : torch.Tensor or Mapping
        The batch.

    Returns
    -------
    torch.Tensor or Mapping
        A detached tensor, or a shallow copy of the mapping (``copy.copy``, so a
        ``UserDict`` subclass stays one) holding detached tensors. The caller's
        mapping is not changed.

    """
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, MutableMapping):
        out = copy.copy(x)
        for key, value in x.items():
            if isinstance(value, torch.Tensor):
                out[key] = value.detach()
        return out
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in x.items()}


def _check_device_and_dtype(
    value: torch.Tensor, model: nn.Module, what: str, ref: str
) -> None:
    """Raise unless ``value`` is on the model's device (and dtype, if floating)."""
    param = next(model.parameters(), None)
    if param is None:
        return
    if value.device != param.device:
        raise InvalidInputError(
            f"{what} is on {value.device} but the model is on {param.device}; move "
            f"it with {ref}.to({str(param.device)!r})."
        )
    if value.is_floating_point() and value.dtype != param.dtype:
        raise InvalidInputError(
            f"{what} has dtype {value.dtype} but the model's parameters are "
            f"{param.dtype}; cast it with {ref}.to({param.dtype})."
        )


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

    Raises
    ------
    InvalidInputError
        If ``f`` is not a tensor of shape ``(batch,)`` or ``(batch, outputs)``.

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
