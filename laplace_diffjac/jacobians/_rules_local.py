"""The local rule: any parameterised module, differentiated on its own by torch.func.

A module without a rule of its own (Hugging Face's ``Conv1D``, a ViT embedding
that adds its class token and position embeddings itself, a hand-written RMSNorm,
``nn.Bilinear``, a recurrent cell) still gets per-sample Jacobians from the
engine: the signals ``(V, B, *out)`` that reach its output are sent back to its
own parameters (those it holds directly, not its children's: those have rules of
their own) through the module alone, sample by sample::

    vmap over b:  out_b, pullback = vjp(p -> functional_call(module, p, inputs_b))
                  vmap over v: pullback(signal[v, b])

The module is rerun on each recorded sample as a batch of one (so a ``forward``
that reads ``x.shape[0]`` works); inputs that lead with the batch size are split
by sample, others (a shared mask) are given whole. The block of each parameter is
a :class:`.Dense` factor. The rerun must give back the recorded output: one that
does not (the module couples the samples, is random or keeps state between
calls) is refused by name. With ``enable_backprop`` the blocks stay connected to
the inputs, the signals and the parameters (``torch.func`` transforms compose
with autograd). ``vmap`` needs batching rules for every operation of the module;
where one is missing, and for recurrent cells (``vmap`` gets them wrong), the
samples are taken one by one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import UnsupportedModuleError
from ._assembly import Dense, Factors
from ._elementary import elementary_forms
from ._in_place import tensors_in
from ._layer_calls import LayerCall
from ._rules_recurrent import SAMPLE_BY_SAMPLE
from ._warnings import quiet_batching_fallbacks


def local_factors(
    call: LayerCall, grads: tuple[torch.Tensor | None, ...], wanted: set[int]
) -> list[tuple[int, Factors]]:
    """:class:`.Dense` blocks of the module's own parameters for these signals.

    Parameters
    ----------
    call : LayerCall
        The recorded call; ``outputs`` are the tensors the module returned.
    grads : tuple of (torch.Tensor or None)
        One entry per tensor of ``call.outputs``: signals ``(V, B, *shape)`` or
        ``None``.
    wanted : set of int
        ``id`` of the parameters of interest.

    Returns
    -------
    list of (int, Factors)
        One :class:`.Dense` block ``(V, B, numel)`` per wanted parameter the
        module holds directly.

    Raises
    ------
    UnsupportedModuleError
        If an output with signals does not lead with the batch, the module run
        on each sample alone does not give back its recorded output, or
        ``torch.func`` cannot differentiate it.

    """
    module = call.module
    params = {
        name: p for name, p in module.named_parameters(recurse=False) if id(p) in wanted
    }
    used = [i for i, g in enumerate(grads) if g is not None]
    if not params or not used:
        return []
    signals = tuple(g for g in grads if g is not None)  # (V, B, *shape) each
    n_rows, batch = signals[0].shape[:2]
    for i in used:
        _check_leads_with_batch(module, call.outputs[i], batch)
    leaves, spec = tree_flatten((call.inputs, call.kwargs))
    dims = [_batch_dim(leaf, batch) for leaf in leaves]
    picks = [_floating_index(call.outputs, i) for i in used]

    def outputs_of(p: dict[str, torch.Tensor], sample: list) -> tuple:
        args, kwargs = tree_unflatten(
            [
                leaf.unsqueeze(0) if dim == 0 else leaf
                for leaf, dim in zip(sample, dims)
            ],
            spec,
        )
        out = functional_call(module, p, tuple(args), kwargs, strict=False)
        floating = [t for t in tensors_in(out) if t.is_floating_point()]
        return tuple(floating[k][0] for k in picks)  # the sample, unbatched

    def per_sample(sample: list, seeds: tuple) -> tuple:
        pulled = vjp(lambda p: outputs_of(p, sample), params)
        out, pullback = pulled[0], pulled[1]
        if any(o.shape != s.shape[1:] for o, s in zip(out, seeds)):
            raise _NotReproduced
        (blocks,) = vmap(pullback)(seeds)  # over the V rows
        return blocks, out

    # its submodules with an elementary form run in it, as in the model's pass
    with (
        elementary_forms(module),
        sdpa_kernel([SDPBackend.MATH]),
        quiet_batching_fallbacks(),
    ):
        loop = any(isinstance(m, SAMPLE_BY_SAMPLE) for m in module.modules())
        try:
            blocks, out = _over_samples(per_sample, leaves, dims, signals, batch, loop)
        except _NotReproduced:
            raise UnsupportedModuleError(_not_reproduced(module)) from None
        except (RuntimeError, NotImplementedError) as err:
            raise UnsupportedModuleError(
                f"{type(module).__name__} has no rule of its own, and torch.func "
                f"cannot differentiate it on one sample alone ({err}); "
                "laplace_diffjac.DiffFuncGGN differentiates the whole model with "
                "torch.func and may fail the same way."
            ) from err
    for recomputed, i in zip(out, used):
        if not _same(recomputed, call.outputs[i]):
            raise UnsupportedModuleError(_not_reproduced(module))
    return [
        (id(p), Dense(blocks[name].transpose(0, 1).reshape(n_rows, batch, -1)))
        for name, p in params.items()
    ]


def _over_samples(
    per_sample: Callable[[list, tuple], tuple],
    leaves: list,
    dims: list[int | None],
    signals: tuple[torch.Tensor, ...],
    batch: int,
    sample_by_sample: bool,
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """``vmap(per_sample)`` over the samples, or a loop where ``vmap`` fails.

    The loop straight away with ``sample_by_sample`` (recurrent cells, see
    ``_rules_recurrent.SAMPLE_BY_SAMPLE``).

    Returns
    -------
    blocks : dict of torch.Tensor
        ``(B, V, *param_shape)`` per parameter name.
    outputs : tuple of torch.Tensor
        The recomputed outputs ``(B, *shape)``.

    """
    if not sample_by_sample:
        try:
            return vmap(per_sample, in_dims=(dims, 1))(leaves, signals)
        except (RuntimeError, NotImplementedError, ValueError):
            pass
    results = [
        per_sample(
            [leaf[b] if dim == 0 else leaf for leaf, dim in zip(leaves, dims)],
            tuple(s[:, b] for s in signals),
        )
        for b in range(batch)
    ]
    blocks = {k: torch.stack([r[0][k] for r in results]) for k in results[0][0]}
    outputs = tuple(torch.stack(column) for column in zip(*(r[1] for r in results)))
    return blocks, outputs


def _batch_dim(leaf: object, batch: int) -> int | None:
    """0 for a tensor that leads with the batch size, else ``None`` (shared)."""
    if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] == batch:
        return 0
    return None


def _floating_index(outputs: tuple[torch.Tensor, ...], i: int) -> int:
    """Position of ``outputs[i]`` among the floating tensors of ``outputs``."""
    return sum(1 for t in outputs[:i] if t.is_floating_point())


def _check_leads_with_batch(
    module: nn.Module, output: torch.Tensor, batch: int
) -> None:
    """Refuse an output with signals whose first dimension is not the batch.

    Raises
    ------
    UnsupportedModuleError
        Naming the module and the shape.

    """
    if output.dim() == 0 or output.shape[0] != batch:
        raise UnsupportedModuleError(
            f"{type(module).__name__} returned a tensor of shape "
            f"{tuple(output.shape)} that the model's outputs depend on and that "
            f"does not lead with the batch size {batch}, so its per-sample "
            "Jacobians cannot be told apart; laplace_diffjac.DiffFuncGGN "
            "differentiates each sample through the whole model."
        )


class _NotReproduced(Exception):
    """The module, run on one sample, returned a tensor of another shape."""


def _same(recomputed: torch.Tensor, recorded: torch.Tensor) -> bool:
    """Whether the rerun gave back the recorded output, up to rounding."""
    recorded, recomputed = recorded.detach(), recomputed.detach()
    eps = torch.finfo(recorded.dtype).eps
    scale = float(recorded.abs().max()) if recorded.numel() else 0.0
    return recomputed.shape == recorded.shape and torch.allclose(
        recomputed, recorded, rtol=1e3 * eps, atol=1e3 * eps * scale
    )


def _not_reproduced(module: nn.Module) -> str:
    """Why a module that, run on each sample alone, gives another output is refused.

    Returns
    -------
    str
        Naming the module and the usual causes.

    """
    return (
        f"{type(module).__name__} has no rule of its own, and run on each sample "
        "alone it does not give back the output it gave in the batch (it couples "
        "the samples, is random, keeps state between calls or writes into its "
        "input in place; or an input shared by the batch, such as a mask, has a "
        "first dimension equal to the batch size and was split by sample), so "
        "its per-sample Jacobians are not defined by the module alone. "
        "laplace_diffjac.DiffFuncGGN differentiates each sample alone through "
        "the whole model; call model.eval() if it is dropout."
    )
