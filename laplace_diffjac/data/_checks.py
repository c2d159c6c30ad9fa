"""Checks on data, locations and likelihoods where they enter, before any work."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidInputError
from ..jacobians._model_guard import preserved_state

__all__ = [
    "LIKELIHOODS",
    "check_fits_model",
    "check_finite",
    "check_inputs",
    "check_targets",
    "check_likelihood",
    "check_like_model",
]

LIKELIHOODS = ("regression", "classification")


def check_likelihood(likelihood: object) -> None:
    """Raise unless ``likelihood`` is ``'regression'`` or ``'classification'``.

    Parameters
    ----------
    likelihood : object
        The likelihood argument.

    Raises
    ------
    InvalidInputError
        Naming the argument and the accepted values.

    """
    if likelihood not in LIKELIHOODS:
        raise InvalidInputError(
            f"likelihood must be 'regression' or 'classification', got {likelihood!r}."
        )


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise if ``x`` holds NaN or infinite entries.

    Parameters
    ----------
    x : torch.Tensor
        Inputs or locations.
    name : str
        Argument name for the message.

    Raises
    ------
    InvalidInputError
        Naming the argument, the number of bad entries and the fix.

    """
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise InvalidInputError(
            f"{name} holds {bad} non-finite (NaN or inf) entries; remove or impute "
            "them before choosing context locations."
        )


def check_like_model(x: torch.Tensor, name: str, model: nn.Module) -> None:
    """Raise if ``x`` is not on the model's device or not in its dtype.

    Parameters
    ----------
    x : torch.Tensor
        Locations.
    name : str
        Argument name for the message.
    model : torch.nn.Module
        The network; its first parameter fixes device and dtype.

    Raises
    ------
    InvalidInputError
        Naming the argument and the cast or move that fixes it.

    """
    param = next(model.parameters())
    if x.device != param.device:
        raise InvalidInputError(
            f"{name} is on {x.device} but the model is on {param.device}; move it "
            f"with {name}.to({str(param.device)!r})."
        )
    if x.dtype != param.dtype:
        raise InvalidInputError(
            f"{name} has dtype {x.dtype} but the model's parameters are "
            f"{param.dtype}; cast it with {name}.to({param.dtype})."
        )


def check_fits_model(x: torch.Tensor, name: str, model: nn.Module) -> None:
    """Raise if one input of ``x`` cannot go through the model to ``(1, C)``.

    One forward pass on ``x[:1]`` without gradients; the model's state (e.g.
    BatchNorm statistics in training mode) is restored afterwards.

    Parameters
    ----------
    x : torch.Tensor
        ``(B, *input_shape)``, ``B >= 1``.
    name : str
        Argument name for the message.
    model : torch.nn.Module
        The network.

    Raises
    ------
    InvalidInputError
        Naming the argument, its feature shape and the model's complaint.

    """
    param = next(model.parameters())
    probe = x[:1].to(device=param.device, dtype=param.dtype)
    try:
        with preserved_state(model), torch.no_grad():
            out = model(probe)
    except (RuntimeError, ValueError, IndexError) as err:
        raise InvalidInputError(
            f"{name} has feature shape {tuple(x.shape[1:])}, which the model does "
            f"not accept ({err}); pass inputs of the shape the model was trained on."
        ) from err
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise InvalidInputError(
            f"The model maps {name} to {getattr(out, 'shape', type(out))}; context "
            "locations need (batch, C) outputs."
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
    if isinstance(x, torch.Tensor) and x.dim() == 1 and x.shape[0] > 0:
        raise InvalidInputError(
            f"{name} has shape {tuple(x.shape)}: one unbatched input (or a batch "
            f"without features); pass a batch of shape (B, *input_shape), e.g. "
            f"{name}.unsqueeze(0) for one input or {name}.unsqueeze(1) for "
            f"{x.shape[0]} scalar inputs."
        )
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
        kind = "floating" if x.is_floating_point() else "an integer or boolean"
        raise InvalidInputError(
            f"{name} is {kind} tensor of dtype {x.dtype} but the model's "
            f"parameters are {dtype}; cast it with {name}.to({dtype})."
        )
    if feature_shape is not None and tuple(x.shape[1:]) != tuple(feature_shape):
        raise InvalidInputError(
            f"{name} has input shape {tuple(x.shape[1:])} but the locations have "
            f"{tuple(feature_shape)}; locations and data must have the same features."
        )
    if not bool(torch.isfinite(x).all()):
        raise InvalidInputError(f"{name} contains NaN or infinite values.")


def check_targets(y: torch.Tensor, f: torch.Tensor, likelihood: str, name: str) -> None:
    """Raise unless ``y`` are targets of the model's outputs ``f`` ``(b, C)``.

    Regression: ``(b, C)``, or ``(b,)`` when ``C = 1``, floating. Classification:
    class indices ``(b,)`` (integer, in ``[0, C)``) or class probabilities
    ``(b, C)`` (floating).

    Parameters
    ----------
    y : torch.Tensor
        The batch's targets.
    f : torch.Tensor
        The model's outputs on the batch, ``(b, C)``.
    likelihood : {'regression', 'classification'}
        The likelihood.
    name : str
        The argument's name, for the message.

    Raises
    ------
    InvalidInputError
        Naming the argument, the shape or dtype found, the one expected and the
        fix.

    """
    b, C = f.shape
    shape = tuple(y.shape)
    if likelihood == "regression":
        if shape not in ((b, C), (b,) if C == 1 else (b, C)):
            raise InvalidInputError(
                f"{name}: regression targets have shape {shape} but the model has "
                f"{C} output(s) for {b} inputs; pass targets of shape ({b}, {C})"
                + (f" or ({b},)" if C == 1 else "")
                + "."
            )
        if not y.is_floating_point():
            raise InvalidInputError(
                f"{name}: regression targets are {y.dtype}; cast them with "
                f"y.to({f.dtype})."
            )
        return
    if shape == (b, C) and y.is_floating_point():
        return  # class probabilities
    if shape not in ((b,), (b, 1)):
        raise InvalidInputError(
            f"{name}: classification targets have shape {shape}; pass class "
            f"indices of shape ({b},) or class probabilities of shape ({b}, {C})."
        )
    if y.is_floating_point():
        raise InvalidInputError(
            f"{name}: class indices are {y.dtype}; cast them with y.long()."
        )
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= C):
        raise InvalidInputError(
            f"{name}: class indices must lie in [0, {C}) for a model with {C} "
            f"outputs; got values in [{int(y.min())}, {int(y.max())}]."
        )
