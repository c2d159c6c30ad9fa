"""The NTK Gram of a model's Linear layers without forming the Jacobians.

For ``nn.Sequential`` chains of ``Linear`` layers and elementwise activations, the
Jacobian of output ``c`` with respect to the weight of layer ``l`` is the outer
product ``g_l[c] ⊗ a_{l-1}``, where ``a_{l-1}`` ``(width_in,)`` is the layer's input
and ``g_l`` ``(C, width_out)`` the output gradients backpropagated to its output.
Hence (Novak et al. 2022, "Fast finite width neural tangent kernel")

    J(x1) J(x2)ᵀ = Σ_l (a_{l-1}(x1)·a_{l-1}(x2) + 1[bias]) · g_l(x1) g_l(x2)ᵀ,

which costs ``B1·B2·(width_in + C²·width_out)`` per layer instead of
``B1·B2·C²·P``, and needs memory ``B1·B2·C²`` plus the activations, never
``B·C·P``. The ``a_{l-1}`` and ``g_l`` are read off the Jacobian engine's pass
(:func:`laplace_diffjac.jacobians._engine.jacobian_pieces`): the engine is the
package's one walker of a model. Everything is ordinary autograd, so the result is
differentiable with respect to both inputs and the parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..jacobians._engine import jacobian_pieces
from ._structured_features import NTKFeatures, feature_gram, features_of

#: Elementwise activations a chain may hold (the engine differentiates them).
ACTIVATIONS = (
    nn.Tanh,
    nn.Sigmoid,
    nn.ReLU,
    nn.GELU,
    nn.SiLU,
    nn.Softplus,
    nn.ELU,
    nn.LeakyReLU,
)

#: Modules that leave a batch of feature vectors unchanged.
_PASS_THROUGH = (nn.Identity, nn.Flatten, nn.Dropout)


def _flat_layers(model: nn.Module) -> list[nn.Module] | None:
    """The leaves of a (nested) ``nn.Sequential`` in call order, else ``None``."""
    if not isinstance(model, nn.Sequential):
        return None
    layers: list[nn.Module] = []
    for child in model:
        if isinstance(child, nn.Sequential):
            inner = _flat_layers(child)
            if inner is None:
                return None
            layers += inner
        else:
            layers.append(child)
    return layers


def _layer_supported(m: nn.Module) -> bool:
    if type(m) is nn.Linear or type(m) in ACTIVATIONS:
        return True
    if type(m) is nn.Flatten:
        return m.start_dim == 1 and m.end_dim == -1
    if type(m) is nn.Dropout:
        return not m.training
    return type(m) is nn.Identity


def _default_params(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def supports_structured_ntk(
    model: nn.Module, params: Iterable[torch.Tensor] | None = None
) -> bool:
    """Whether :func:`structured_ntk` computes ``J Jᵀ`` of ``model`` w.r.t. ``params``.

    Parameters
    ----------
    model : torch.nn.Module
        Candidate model.
    params : iterable of torch.Tensor, optional
        The parameters of the Jacobian (laplace-torch's ``backend.params``); by
        default those of ``model`` that require gradients.

    Returns
    -------
    bool
        ``True`` if ``model`` is a (nested) ``nn.Sequential`` of ``Linear``, the
        elementwise activations in :data:`ACTIVATIONS`, ``Identity``,
        ``Flatten()`` and evaluation-mode ``Dropout``, and ``params`` are
        exactly the model's parameters that require gradients.

    """
    layers = _flat_layers(model)
    if layers is None or not layers or not all(map(_layer_supported, layers)):
        return False
    chosen = _default_params(model) if params is None else list(params)
    expected = {id(p) for p in _default_params(model)}
    return {id(p) for p in chosen} == expected and len(chosen) == len(expected)


def structured_ntk(
    model: nn.Module,
    x1: torch.Tensor,
    x2: torch.Tensor | None = None,
    prior_precision: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Prior-scaled NTK ``J(x1) J(x2)ᵀ / prior_precision``, without forming ``J``.

    Parameters
    ----------
    model : torch.nn.Module
        A model for which :func:`supports_structured_ntk` is ``True``; the Jacobian
        is taken with respect to its parameters that require gradients.
    x1 : torch.Tensor
        ``(B1, *input_shape)``; flattened to ``(B1, D)`` only by a ``Flatten``.
    x2 : torch.Tensor, optional
        ``(B2, *input_shape)``; ``None`` means ``x1`` (one forward pass).
    prior_precision : float or torch.Tensor, default=1.0
        Scalar (0-d or one-element) prior precision.

    Returns
    -------
    torch.Tensor
        ``(B1, B2, C, C)``, laplace-torch's kernel layout: entry ``[b, d, c, e]`` is
        ``Σ_p J[b, c, p] J[d, e, p] / prior_precision`` (``einsum("bcp,dep->bdce")``).
        Differentiable with respect to ``x1``, ``x2`` and the parameters.

    Raises
    ------
    ValueError
        If the model is unsupported, the prior precision is not a scalar, or a
        ``Linear`` layer receives a non-2-D input or the output is not ``(B, C)``.

    """
    check_structured(model)
    if isinstance(prior_precision, torch.Tensor) and prior_precision.numel() != 1:
        raise ValueError("structured_ntk needs a scalar prior precision.")
    f1 = structured_features(model, x1)
    f2 = f1 if x2 is None else structured_features(model, x2)
    n1, n2, c = len(f1), len(f2), f1.n_outputs
    kernel = feature_gram(f1, f2).reshape(n1, c, n2, c)
    return kernel.permute(0, 2, 1, 3) / prior_precision


def check_structured(model: nn.Module) -> None:
    """Raise unless :func:`supports_structured_ntk` holds for ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        Candidate model (all its parameters that require grad).

    Raises
    ------
    ValueError
        If the structured route does not apply, naming the alternative.

    """
    if not supports_structured_ntk(model):
        raise ValueError(
            "structured_ntk supports nn.Sequential chains of Linear layers and "
            f"elementwise activations ({', '.join(t.__name__ for t in ACTIVATIONS)}, "
            "Identity, Flatten, eval-mode Dropout); use laplace_diffjac.kernels.ntk."
        )


def structured_features(model: nn.Module, x: torch.Tensor) -> NTKFeatures:
    """One side's pieces of :func:`structured_ntk` (see :class:`NTKFeatures`).

    Parameters
    ----------
    model : torch.nn.Module
        A model for which :func:`supports_structured_ntk` is ``True``.
    x : torch.Tensor
        ``(B, *input_shape)``.

    Returns
    -------
    NTKFeatures
        Differentiable with respect to ``x`` and the parameters;
        ``feature_gram(structured_features(m, x1), structured_features(m, x2))``
        is ``J(x1) J(x2)ᵀ`` as a ``(B1 C, B2 C)`` matrix.

    Raises
    ------
    ValueError
        If the model is unsupported or a Linear layer gets a non-2-D input.

    """
    check_structured(model)
    params = _default_params(model)
    pieces = jacobian_pieces(model, x, params, enable_backprop=torch.is_grad_enabled())
    features = features_of(pieces, params)
    if features is None:
        raise ValueError(
            "structured_ntk needs (batch, features) inputs to every Linear layer; "
            f"got inputs of shape {tuple(x.shape)}. Add nn.Flatten() or use "
            "laplace_diffjac.kernels.ntk."
        )
    return features


__all__ = [
    "ACTIVATIONS",
    "check_structured",
    "structured_features",
    "structured_ntk",
    "supports_structured_ntk",
]
