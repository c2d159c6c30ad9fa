"""Run a BackPACK extension (DiagGGN, KFAC, ...) on one batch without side effects.

BackPACK's ``extend`` registers hooks whose handles live in the process-global
``CTX``; laplace-torch then clears them with ``CTX.remove_hooks()``, which strips the
hooks of every other extended model. Here the same two BackPACK hooks are registered
with handles local to one call, only on modules that do not already carry them (a
model the user extended keeps its own), and the backward pass is a
``torch.autograd.grad`` that writes no ``.grad``. Results are read off the parameters
and the model is restored by :func:`.model_guard.preserved_state`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from backpack import backpack, hook_run_extensions, hook_store_io
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.utils.module_classification import is_no_op
from torch import nn

from ..errors import UnsupportedModuleError
from ._derivatives import owning_modules
from ._functorch_refusals import functorch_refusals, kfac_refusals
from ._in_place import is_hooked_view_write, out_of_place_modules
from ._model_guard import preserved_state
from ._warnings import quiet_full_backward_hook_warning


def run_extension(
    model: nn.Module,
    root: nn.Module,
    lossfunc: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    extension: BackpropExtension,
    params: Sequence[torch.Tensor],
    *,
    flatten_classification: bool,
) -> tuple[torch.Tensor, list[object]]:
    """Run ``extension`` on ``lossfunc(model(x), y)``; return per-parameter results.

    Parameters
    ----------
    model : torch.nn.Module
        Full model, called as ``model(x)``.
    root : torch.nn.Module
        Submodule whose parameters the extension is computed for.
    lossfunc : torch.nn.Module
        Sum-reduced loss module (``MSELoss`` or ``CrossEntropyLoss``).
    x, y : torch.Tensor
        Batch and targets.
    extension : BackpropExtension
        A BackPACK extension instance.
    params : sequence of torch.Tensor
        Parameters whose results are returned, in order.
    flatten_classification : bool
        Reshape outputs to ``(-1, C)`` and targets to ``(-1,)`` as laplace-torch does
        for classification.

    Returns
    -------
    loss : torch.Tensor
        The detached loss.
    results : list
        ``getattr(param, extension.savefield)`` for each parameter.

    Raises
    ------
    UnsupportedModuleError
        If a module on the path has no BackPACK rule for ``extension``, the
        forward writes in place into a module's output (modules with
        ``inplace=True`` run out of place here), BackPACK cannot follow the model
        (a branch, an operation outside a module), or the extension produced no
        result for some parameter.

    """
    savefield = extension.savefield
    with preserved_state(model, lossfunc), torch.enable_grad():
        with (
            _private_backpack_hooks([root, lossfunc]),
            quiet_full_backward_hook_warning(),
            out_of_place_modules(model),  # BackPACK's hooked outputs are views
        ):
            x_in = x.detach()
            if x_in.is_floating_point():
                x_in.requires_grad_(True)
            with _forward_refusals(extension, model, root, params):
                f = model(x_in)
            if flatten_classification:
                f, y = f.view(-1, f.size(-1)), y.view(-1)
            loss = lossfunc(f, y)
            inputs = [t for t in (x_in, *params) if t.requires_grad]
            with _backward_refusals(extension, model, root, params):
                with backpack(extension):
                    torch.autograd.grad(loss, inputs, allow_unused=True)
        missing = [i for i, p in enumerate(params) if not hasattr(p, savefield)]
        if missing:
            raise UnsupportedModuleError(
                f"BackPACK's {type(extension).__name__} produced no result for "
                f"{len(missing)} parameter(s); a module owning them is not supported."
            )
        results = [getattr(p, savefield) for p in params]
    return loss.detach(), results


def curvature_routes(
    model: nn.Module, root: nn.Module, params: Sequence[torch.Tensor]
) -> str:
    """The curvature structures and backends that do work on this model.

    ``'full'`` from this backend's Jacobians if its engine has a rule for every
    module; ``'diag'`` and ``'full'`` from ``DiffFuncGGN`` unless it refuses a
    module, and its ``'kron'`` if curvlinops' KFAC factorises every parameter.

    Returns
    -------
    str
        One or two sentences.

    """
    routes = []
    try:
        owning_modules(root, params)
        routes.append("with this backend hessian_structure='full' works")
    except UnsupportedModuleError:
        pass
    refused = functorch_refusals(model)
    if not refused:
        kinds = "'diag' and 'full'"
        if not kfac_refusals(root, params):
            kinds = "'diag', 'full' and 'kron'"
        routes.append(f"{kinds} work with laplace_diffjac.DiffFuncGGN")
    if not routes:
        return (
            "No backend of this package takes the model as it is: "
            f"{', '.join(refused)}."
        )
    sentence = "; ".join(routes)
    return sentence[0].upper() + sentence[1:] + "."


@contextmanager
def _forward_refusals(
    extension: BackpropExtension,
    model: nn.Module,
    root: nn.Module,
    params: Sequence[torch.Tensor],
) -> Iterator[None]:
    """The forward pass's failure under BackPACK's hooks, as a refusal.

    Yields
    ------
    None

    Raises
    ------
    UnsupportedModuleError
        If the forward writes in place into a hooked module's output.
    RuntimeError
        Any other failure of the forward pass, unchanged.

    """
    try:
        yield
    except RuntimeError as err:
        if not is_hooked_view_write(err):
            raise
        raise UnsupportedModuleError(
            f"BackPACK's {type(extension).__name__} cannot run this model: its "
            "forward writes in place into a module's output (for instance "
            "`out += identity` at the end of a residual block), which BackPACK's "
            f"backward hooks forbid. {curvature_routes(model, root, params)}"
        ) from err


@contextmanager
def _backward_refusals(
    extension: BackpropExtension,
    model: nn.Module,
    root: nn.Module,
    params: Sequence[torch.Tensor],
) -> Iterator[None]:
    """BackPACK's failures while it backpropagates, as refusals naming a route.

    Yields
    ------
    None

    Raises
    ------
    UnsupportedModuleError
        If a module has no rule for ``extension``, or BackPACK cannot follow the
        model from module to module (a branch, an operation outside a module).
    RuntimeError
        A failure outside BackPACK's code (out of memory, the model's own),
        unchanged.

    """
    name = type(extension).__name__
    try:
        yield
    except AssertionError as err:
        # BackPACK's second-order extensions backpropagate one quantity through a
        # chain of modules; a branch (a residual or LoRA sum) or an operation
        # outside a module leaves a module without one.
        raise UnsupportedModuleError(
            f"BackPACK's {name} needs a sequential model; this one branches or "
            "applies an operation outside a module (such as torch.tanh; nn.Tanh "
            f"is a module) ({err}). {curvature_routes(model, root, params)}"
        ) from err
    except NotImplementedError as err:
        raise UnsupportedModuleError(
            f"BackPACK's {name} does not support a module of this model ({err}). "
            f"{curvature_routes(model, root, params)}"
        ) from err
    except RuntimeError as err:
        if isinstance(err, torch.OutOfMemoryError) or not _raised_by_backpack(err):
            raise
        # its shape checks: an operation between modules that BackPACK does not
        # see (torch.flatten in a forward) changed the shape
        raise UnsupportedModuleError(
            f"BackPACK's {name} cannot follow this model "
            f"({' '.join(map(str, err.args))}): it goes from module to module, and "
            "an operation between modules in a forward (such as torch.flatten; "
            "nn.Flatten is a module) is not seen. "
            f"{curvature_routes(model, root, params)}"
        ) from err


@contextmanager
def _private_backpack_hooks(roots: Sequence[nn.Module]) -> Iterator[None]:
    """Install BackPACK's IO and extension hooks with handles local to this call."""
    handles = []
    try:
        for root in roots:
            for module in root.modules():
                if (
                    is_no_op(module)
                    or _is_container(module)
                    or _has_backpack_hooks(module)
                ):
                    continue
                handles.append(module.register_forward_hook(hook_store_io))
                handles.append(module.register_full_backward_hook(hook_run_extensions))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _raised_by_backpack(err: BaseException) -> bool:
    """Whether the innermost frame of ``err``'s traceback is BackPACK's code."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).startswith("backpack.")


def _is_container(module: nn.Module) -> bool:
    """A module that only calls children and owns no parameter (a custom block).

    Its children carry the hooks; on the container itself BackPACK would find no
    extension and warn about the children's parameters.

    Returns
    -------
    bool
        Whether the module has children and no parameter of its own.

    """
    has_children = next(module.children(), None) is not None
    return has_children and next(module.parameters(recurse=False), None) is None


def _has_backpack_hooks(module: nn.Module) -> bool:
    """Whether the user already extended ``module`` (identity check of the hooks)."""
    return any(h is hook_store_io for h in module._forward_hooks.values())
