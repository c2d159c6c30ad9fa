"""The NTK Gram of Linear/activation chains without forming the Jacobians.

For ``nn.Sequential`` chains of ``Linear`` layers and elementwise activations, the
Jacobian of output ``c`` with respect to the weight of layer ``l`` is the outer
product ``g_l[c] ⊗ a_{l-1}``, where ``a_{l-1}`` ``(width_in,)`` is the layer's input
and ``g_l`` ``(C, width_out)`` the output gradients backpropagated to its output.
Hence (Novak et al. 2022, "Fast finite width neural tangent kernel")

    J(x1) J(x2)ᵀ = Σ_l (a_{l-1}(x1)·a_{l-1}(x2) + 1[bias]) · g_l(x1) g_l(x2)ᵀ,

which costs ``B1·B2·(width_in + C²·width_out)`` per layer instead of
``B1·B2·C²·P``, and needs memory ``B1·B2·C²`` plus the activations, never
``B·C·P``. Everything is ordinary autograd, so the result is differentiable with
respect to both inputs and the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

_Derivative = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _gelu(m: nn.GELU, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    if m.approximate == "tanh":
        k = (2.0 / torch.pi) ** 0.5
        t = torch.tanh(k * (z + 0.044715 * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t**2) * k * (1 + 3 * 0.044715 * z**2)
    cdf = 0.5 * (1 + torch.erf(z * 2**-0.5))
    pdf = torch.exp(-0.5 * z**2) / (2 * torch.pi) ** 0.5
    return cdf + z * pdf


def _silu(m: nn.Module, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def _softplus(m: nn.Softplus, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    bz = m.beta * z
    return torch.where(bz > m.threshold, torch.ones_like(z), torch.sigmoid(bz))


def _elu(m: nn.ELU, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.where(z > 0, torch.ones_like(z), m.alpha * torch.exp(z))


def _leaky_relu(m: nn.LeakyReLU, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.where(z > 0, torch.ones_like(z), torch.full_like(z, m.negative_slope))


#: Elementwise activations and their derivatives ``d(module, z, module(z))``.
ACTIVATIONS: dict[type[nn.Module], _Derivative] = {
    nn.Tanh: lambda m, z, a: 1 - a**2,
    nn.Sigmoid: lambda m, z, a: a * (1 - a),
    nn.ReLU: lambda m, z, a: (z > 0).to(z.dtype),
    nn.GELU: _gelu,
    nn.SiLU: _silu,
    nn.Softplus: _softplus,
    nn.ELU: _elu,
    nn.LeakyReLU: _leaky_relu,
}

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
    if not supports_structured_ntk(model):
        raise ValueError(
            "structured_ntk supports nn.Sequential chains of Linear layers and "
            f"elementwise activations ({', '.join(t.__name__ for t in ACTIVATIONS)}, "
            "Identity, Flatten, eval-mode Dropout); use laplace_diffjac.kernels.ntk."
        )
    if isinstance(prior_precision, torch.Tensor) and prior_precision.numel() != 1:
        raise ValueError("structured_ntk needs a scalar prior precision.")
    layers = _flat_layers(model)
    assert layers is not None
    wanted = {id(p) for p in _default_params(model)}
    trace1 = _forward_trace(layers, x1)
    trace2 = trace1 if x2 is None else _forward_trace(layers, x2)
    sig1 = _output_signals(trace1)
    sig2 = sig1 if x2 is None else _output_signals(trace2)
    out1, out2 = trace1[-1], trace2[-1]
    n1, c = out1.shape
    n2 = out2.shape[0]
    kernel = out1.new_zeros((n1, c, n2, c))
    eye = torch.eye(c, dtype=out1.dtype, device=out1.device)
    for (linear, a1, g1), (_, a2, g2) in zip(sig1, sig2):
        scale = _input_gram(linear, a1, a2, wanted)
        if scale is None:
            continue
        if g1 is None:  # the last layer: g = identity
            kernel = kernel + scale[:, None, :, None] * eye[None, :, None, :]
        else:
            gram = g1.reshape(n1 * c, -1) @ g2.reshape(n2 * c, -1).T
            kernel = kernel + scale[:, None, :, None] * gram.reshape(n1, c, n2, c)
    return kernel.permute(0, 2, 1, 3) / prior_precision


def _forward_trace(layers: Sequence[nn.Module], x: torch.Tensor) -> list:
    """Run the chain and record what the output signals need.

    Returns ``[op, ..., output]`` with ``op`` either ``('linear', module, input)``
    or ``('scale', derivative (B, width))``.
    """
    ops: list = []
    h = x
    for m in layers:
        if type(m) is nn.Linear:
            if h.dim() != 2:
                raise ValueError(
                    "structured_ntk needs (batch, features) inputs to every Linear "
                    f"layer; got {tuple(h.shape)}. Add nn.Flatten() or use "
                    "laplace_diffjac.kernels.ntk."
                )
            ops.append(("linear", m, h))
            h = F.linear(h, m.weight, m.bias)
        elif type(m) in ACTIVATIONS:
            z = h
            a = m(z.clone() if getattr(m, "inplace", False) else z)
            ops.append(("scale", ACTIVATIONS[type(m)](m, z, a)))
            h = a
        elif type(m) is nn.Flatten:
            h = h.flatten(start_dim=1)
        # Identity and eval-mode Dropout: nothing to do.
    if h.dim() != 2:
        raise ValueError(f"structured_ntk needs (batch, C) outputs, got {h.shape}.")
    ops.append(h)
    return ops


def _output_signals(trace: list) -> list[tuple[nn.Linear, torch.Tensor, object]]:
    """Backpropagate the identity on the output to every Linear layer's output.

    Returns ``(linear, input (B, in), g (B, C, out) or None for identity)`` per
    Linear layer, in forward order.
    """
    g: torch.Tensor | None = None
    result = []
    remaining = sum(1 for op in trace[:-1] if op[0] == "linear")
    for op in reversed(trace[:-1]):
        if remaining == 0:
            break
        if op[0] == "scale":
            d = op[1]
            g = torch.diag_embed(d) if g is None else g * d[:, None, :]
        else:
            linear, a = op[1], op[2]
            result.append((linear, a, g))
            remaining -= 1
            if remaining == 0:
                break
            weight = linear.weight
            if g is None:
                g = weight.expand(a.shape[0], *weight.shape)
            else:
                g = g @ weight
    return result[::-1]


def _input_gram(
    linear: nn.Linear, a1: torch.Tensor, a2: torch.Tensor, wanted: set[int]
) -> torch.Tensor | None:
    """``a1 a2ᵀ [+ 1]`` ``(B1, B2)`` for the wanted weight [and bias], else None."""
    scale = None
    if id(linear.weight) in wanted:
        scale = a1 @ a2.T
    if linear.bias is not None and id(linear.bias) in wanted:
        scale = 1.0 + scale if scale is not None else a1.new_ones(len(a1), len(a2))
    return scale


__all__ = ["ACTIVATIONS", "structured_ntk", "supports_structured_ntk"]
