"""Closed-form per-sample Jacobian factors of ``nn.Conv1d``/``2d``/``3d`` (groups 1).

A convolution is a Linear layer applied at every output position to the unfolded
input patches, so its factors are :class:`.Product` factors of the signals and
the patches (``torch.nn.functional.unfold`` in 1-D and 2-D, BackPACK's dependency
``unfoldNd`` in 3-D). Padding modes other than zeros are applied to the input first, as
the module's own forward does; BackPACK's derivatives (used for the other
convolutions) assume zero padding, so those are refused with another mode.
"""

from __future__ import annotations

from typing import Union, cast

import torch
from torch import nn
from unfoldNd import unfoldNd

from ._assembly import Factors, Product, Summed
from ._layer_calls import LayerCall


def batch_first(g: torch.Tensor) -> torch.Tensor:
    """``(V, B, out, L)`` signals as ``(B, V, out, L)``: a view for ``L == 1``.

    With more than one position the product is a ``bmm`` over the batch, whose
    left factor must be contiguous; the copy is made here, in the autograd graph,
    so that the Jacobian stays differentiable twice.

    Returns
    -------
    torch.Tensor
        ``(B, V, out, L)``.

    """
    g = g.transpose(0, 1)
    return g if g.shape[3] == 1 else g.contiguous()


#: Convolutions with a ``padding_mode``; BackPACK's derivatives assume zeros.
PADDED_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def has_closed_form_conv(module: nn.Module) -> bool:
    """Conv1d/2d/3d with groups 1: zero padding given as sizes, or any other mode."""
    return bool(
        type(module) in PADDED_CONVS
        and module.groups == 1
        and (module.padding_mode != "zeros" or not isinstance(module.padding, str))
    )


def conv_factors(
    call: LayerCall, grad: torch.Tensor, wanted: set[int]
) -> list[tuple[int, Factors]]:
    """Closed-form ``nn.Conv1d``/``2d``/``3d`` factors (groups 1).

    A convolution is a Linear layer applied at every output position to the
    unfolded input patches ``(batch, C_in·∏kernel, L)``, so its factors are those
    of :func:`_linear_factors` with the ``L`` positions as the extra dimensions. A
    1-D convolution is unfolded as a 2-D one of height 1.

    Returns
    -------
    list of (int, Factors)
        As for :func:`_linear_factors`, with the unfolded patches as inputs.

    """
    module = cast(Union[nn.Conv1d, nn.Conv2d, nn.Conv3d], call.module)
    n_rows, batch = grad.shape[0], grad.shape[1]
    g = grad.reshape(n_rows, batch, module.out_channels, -1)  # (V, B, out, L)
    blocks: list[tuple[int, Factors]] = []
    if id(module.weight) in wanted:
        x, geometry = call.inputs[0], _conv_geometry(module)
        if module.padding_mode != "zeros":  # as the module's forward pads
            x = torch.nn.functional.pad(
                x, module._reversed_padding_repeated_twice, mode=module.padding_mode
            )
            geometry["padding"] = (0,) * len(geometry["kernel_size"])
        if isinstance(module, nn.Conv1d):
            x = x.unsqueeze(2)  # (B, C_in, 1, L_in)
        if isinstance(module, nn.Conv3d):
            patches = unfoldNd(x, **geometry)  # (B, C_in·k, L)
        else:
            patches = torch.nn.functional.unfold(x, **geometry)
        blocks.append(
            (id(module.weight), Product(batch_first(g), patches.transpose(1, 2)))
        )
    if module.bias is not None and id(module.bias) in wanted:
        blocks.append((id(module.bias), Summed(g)))
    return blocks


def _conv_geometry(
    module: nn.Conv1d | nn.Conv2d | nn.Conv3d,
) -> dict[str, tuple[int, ...]]:
    """Kernel size, dilation, padding and stride for ``unfold`` (2-D, or 3-D)."""
    names = ("kernel_size", "dilation", "padding", "stride")
    values = {n: cast(tuple[int, ...], getattr(module, n)) for n in names}
    if isinstance(module, nn.Conv1d):  # height 1: kernel 1, dilation 1, no padding
        return {n: ((1 if n != "padding" else 0), *v) for n, v in values.items()}
    return values
