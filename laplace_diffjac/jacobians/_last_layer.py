"""Closed-form, graph-connected Jacobians of a final ``nn.Linear`` layer."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModuleError
from ._inputs import check_model_output
from ._layer_calls import recorded_calls
from ._model_guard import preserved_state


def last_layer_jacobians(
    model: nn.Module, x: object, enable_backprop: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Jacobians with respect to the parameters of ``model.last_layer``.

    For ``f = W phi(x) + b`` the Jacobian is ``phi(x)`` placed in each output's row
    block, followed by an identity block for the bias, exactly laplace-torch's
    layout. The features ``phi(x)`` are read with a hook local to this call, so they
    stay connected to the graph of ``x`` even when laplace-torch's
    ``FeatureExtractor`` detaches its own copy.

    Parameters
    ----------
    model : torch.nn.Module
        A model with a ``last_layer`` attribute that is an ``nn.Linear`` (for
        instance laplace-torch's ``FeatureExtractor``).
    x : torch.Tensor or mapping
        Input batch.
    enable_backprop : bool, default=False
        Keep the results connected to the graph of ``x`` and the parameters.

    Returns
    -------
    Js : torch.Tensor
        ``(batch, C, C * D + C)`` (without the last block if there is no bias).
    f : torch.Tensor
        ``(batch, C)``.

    Raises
    ------
    UnsupportedModuleError
        If ``model.last_layer`` is not an ``nn.Linear``, is not called by the
        model, or does not take ``(batch, features)`` inputs.

    """
    last = getattr(model, "last_layer", None)
    if not isinstance(last, nn.Linear):
        raise UnsupportedModuleError(
            "last_layer_jacobians needs a model whose `last_layer` is an nn.Linear "
            f"(got {type(last).__name__}); wrap the model in laplace-torch's "
            "FeatureExtractor or use last_layer=False."
        )
    with (
        preserved_state(model),
        torch.set_grad_enabled(enable_backprop or torch.is_grad_enabled()),
    ):
        with recorded_calls([last]) as calls:
            f = model(x)
    if not calls:
        raise UnsupportedModuleError("The model's last_layer was not called.")
    phi = _reduced_features(
        calls[-1].inputs[0], getattr(model, "feature_reduction", None)
    )
    f = check_model_output(f, phi.shape[0])
    batch, n_out = phi.shape[0], last.out_features
    eye = torch.eye(n_out, dtype=phi.dtype, device=phi.device)
    Js = torch.einsum("bd,ij->bijd", phi, eye).reshape(batch, n_out, -1)
    if last.bias is not None:
        Js = torch.cat([Js, eye.expand(batch, n_out, n_out)], dim=2)
    if not enable_backprop:
        return Js.detach(), f.detach()
    return Js, f


def _reduced_features(phi: torch.Tensor, reduction: object) -> torch.Tensor:
    """``(batch, features)`` from the last layer's input, as laplace-torch 0.3 reduces.

    laplace-torch's ``FeatureExtractor(feature_reduction=...)`` serves models that
    apply the last layer to every token ``(batch, seq, D)`` and return one output
    row per sample: ``"pick_first"``/``"pick_last"`` take that token's features,
    ``"average"`` their mean over the intermediate dimensions.

    Returns
    -------
    torch.Tensor
        ``(batch, D)``.

    Raises
    ------
    UnsupportedModuleError
        For inputs with more than two dimensions and no (known) reduction.

    """
    if phi.dim() == 2:
        return phi
    tokens = phi.flatten(start_dim=1, end_dim=-2)  # (batch, positions, D)
    if reduction == "pick_first":
        return tokens[:, 0]
    if reduction == "pick_last":
        return tokens[:, -1]
    if reduction == "average":
        return tokens.mean(dim=1)
    raise UnsupportedModuleError(
        f"The last layer's input has shape {tuple(phi.shape)}; closed-form "
        "last-layer Jacobians need (batch, features). For sequence models pass "
        "feature_reduction='pick_first', 'pick_last' or 'average' to laplace-torch "
        "(0.3), as its own backends need too."
    )
