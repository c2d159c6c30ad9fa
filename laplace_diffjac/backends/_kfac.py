"""Kronecker-factored GGN (KFAC) through curvlinops, as laplace-torch ``Kron`` factors.

curvlinops' ``KFACLinearOperator`` (a dependency of laplace-torch 0.2.3 and 0.3)
records each ``Linear``/``Conv2d`` input and output gradient with hooks it removes
again, and backpropagates with ``torch.autograd.grad``, so no ``.grad`` is written.
Its factors are read through its public ``state_dict()`` and laid out per
*parameter* in the order of ``params``, in the convention of BackPACK's ``KFLR``:
``[G, A]`` for a weight (output-gradient factor first), ``[G]`` for a bias, and
nothing for a frozen parameter, which curvlinops never sees. ``Conv2d`` layers get
BackPACK's factors too (see :func:`kfac_factors`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from curvlinops import KFACLinearOperator
from curvlinops.kfac import FisherType, KFACType
from laplace.utils import Kron
from torch import nn

from ..errors import UnsupportedModuleError
from ..jacobians._functorch_refusals import functorch_refusals, kfac_refusals
from ..jacobians._layer_calls import recorded_calls
from ..jacobians._model_guard import preserved_state


def check_kfac_support(model: nn.Module, params: Sequence[torch.Tensor]) -> None:
    """Raise unless every parameter in ``params`` belongs to a ``Linear``/``Conv2d``.

    Parameters
    ----------
    model : torch.nn.Module
        The network the factors are computed on.
    params : sequence of torch.Tensor
        The trainable parameters.

    Raises
    ------
    UnsupportedModuleError
        Naming the modules curvlinops' KFAC cannot factorise and the routes that
        work: ``'diag'``/``'full'`` with ``DiffFuncGGN``, ``'kron'`` with
        ``DiffBackPackGGN``.

    """
    others = kfac_refusals(model, params)
    if others:
        raise UnsupportedModuleError(
            "Kronecker factors (curvlinops KFAC) exist for nn.Linear and nn.Conv2d "
            f"(groups=1, zero padding) parameters only; {others} own trainable "
            f"parameters. Freeze them (requires_grad=False), or{_fixes_first(model)} "
            "use hessian_structure='diag' or 'full' with this backend, or "
            "laplace_diffjac.DiffBackPackGGN for hessian_structure='kron' (built "
            "from its engine's per-layer factors, which cover these modules)."
        )


def _fixes_first(model: nn.Module) -> str:
    """What every backend needs fixed first (dropout, batch norm in training)."""
    refused = functorch_refusals(model)
    if not refused:
        return ""
    return f" after fixing {', '.join(refused)},"


def kfac_factors(
    model: nn.Module,
    lossfunc: nn.Module,
    params: Sequence[torch.Tensor],
    x: Any,
    y: torch.Tensor,
    *,
    stochastic: bool = False,
) -> tuple[torch.Tensor, Kron]:
    """Loss and Kronecker-factored GGN (or MC Fisher) of ``lossfunc(model(x), y)``.

    Parameters
    ----------
    model : torch.nn.Module
        Network called as ``model(x)``, output ``(batch, ..., C)`` (regression) or
        ``(batch, C, ...)`` (classification, as ``CrossEntropyLoss`` takes it).
    lossfunc : torch.nn.Module
        Sum-reduced ``MSELoss`` or ``CrossEntropyLoss``.
    params : sequence of torch.Tensor
        Trainable parameters, each owned by an ``nn.Linear`` or ``nn.Conv2d``.
    x : torch.Tensor or mapping
        Input batch ``(batch, *input_shape)``, or a mapping of such tensors.
    y : torch.Tensor
        Targets.
    stochastic : bool, default=False
        One Monte-Carlo label per sample (curvlinops' fixed seed) instead of the
        exact loss Hessian.

    Returns
    -------
    loss : torch.Tensor
        ``lossfunc(model(x), y)``, detached.
    kron : laplace.utils.Kron
        One block per parameter: ``[G (out, out), A (in, in)]`` for weights,
        ``[G (out, out)]`` for biases; ``A`` averages over the batch, ``G`` sums.
        For ``Conv2d`` layers the factors are BackPACK's: ``G`` is the exact GGN
        of the bias (curvlinops' KFAC-reduce), ``A`` sums the unfolded input's
        outer products over output positions.

    Raises
    ------
    UnsupportedModuleError
        If a parameter belongs to another module type.

    """
    params = list(params)
    check_kfac_support(model, params)
    fisher = FisherType.MC if stochastic else FisherType.TYPE2
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    approx = KFACType.REDUCE if has_conv else KFACType.EXPAND
    if isinstance(x, Mapping):
        x = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in x.items()}
        batch = next(v for v in x.values() if isinstance(v, torch.Tensor)).shape[0]
        extra = {"batch_size_fn": lambda _: batch}
    else:
        x, batch, extra = x.detach(), x.shape[0], {}
    with preserved_state(model, lossfunc), torch.enable_grad():
        linop = KFACLinearOperator(
            model,
            lossfunc,
            params,
            [(x, y.detach())],
            check_deterministic=False,
            fisher_type=fisher,
            separate_weight_and_bias=True,
            num_data=batch,
            kfac_approx=approx,
            **extra,
        )
        linop.compute_kronecker_factors()
        state = linop.state_dict()
    mapping = KFACLinearOperator.compute_parameter_mapping(params, model)
    loss, conv_inputs = _loss_and_conv_inputs(model, lossfunc, x, y, mapping)
    blocks: list[list[torch.Tensor]] = [[] for _ in params]
    for module, names in mapping.items():
        grad_cov = state["gradient_covariances"][module].detach()
        for name, index in names.items():
            if name != "weight":
                blocks[index] = [grad_cov]
            elif module in conv_inputs:
                blocks[index] = [grad_cov, conv_inputs[module]]
            else:
                blocks[index] = [grad_cov, state["input_covariances"][module].detach()]
    return loss, Kron(blocks)


def _loss_and_conv_inputs(
    model: nn.Module,
    lossfunc: nn.Module,
    x: Any,
    y: torch.Tensor,
    mapping: dict[str, dict[str, int]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and, per ``Conv2d`` weight, BackPACK's input factor, in one forward.

    BackPACK's ``KFLR`` sums the unfolded input's outer products over output
    positions and averages over the batch, ``(C_in k_h k_w, C_in k_h k_w)``.

    Returns
    -------
    loss : torch.Tensor
        ``lossfunc(model(x), y)``.
    factors : dict of str to torch.Tensor
        The input factor of each ``Conv2d`` weight, by module name.

    """
    convs: dict[str, nn.Conv2d] = {}
    for name, names in mapping.items():
        module = model.get_submodule(name)
        if isinstance(module, nn.Conv2d) and "weight" in names:
            convs[name] = module
    with preserved_state(model, lossfunc), torch.no_grad():
        with recorded_calls(list(convs.values())) as calls:
            loss = lossfunc(model(x), y)
    factors: dict[str, torch.Tensor] = {}
    for name, conv in convs.items():
        inputs = [c.inputs[0] for c in calls if c.module is conv]
        patches = [_unfold(conv, t) for t in inputs]
        total = torch.stack([torch.einsum("bik,bjk->ij", p, p) for p in patches])
        factors[name] = total.sum(0) / inputs[0].shape[0]
    return loss.detach(), factors


def _unfold(conv: nn.Conv2d, inputs: torch.Tensor) -> torch.Tensor:
    """Patches ``(batch, C_in k_h k_w, positions)`` of a zero-padded ``Conv2d``."""
    return nn.functional.unfold(
        inputs.detach(),
        conv.kernel_size,
        dilation=conv.dilation,
        padding=conv.padding,  # type: ignore[arg-type]
        stride=conv.stride,
    )


__all__ = ["check_kfac_support", "kfac_factors"]
