"""The one mechanism behind the BackPACK backends: Jacobians in one forward pass.

1. One forward pass records the input and output of every module that owns a
   parameter of interest (:mod:`.layer_calls`); attention is redone there with its
   projections kept as tensors, so that its rule gets signals at them.
2. One vectorised ``torch.autograd.grad`` (under ``torch.func.vmap``) sends all C
   output signals back to those tensors at once. ``autograd.grad`` accumulates into
   no ``.grad`` and, as it is asked only for module outputs, fires no hook on the
   input or on leaves upstream of it.
3. Per-module rules (:mod:`.derivatives`: closed forms for Linear and Conv2d,
   BackPACK's derivatives otherwise) turn the signals at each module into factors
   of the per-sample parameter Jacobians, which :mod:`.jacobian_blocks` writes
   straight into one ``(batch, C, P)`` tensor (no per-block copies, no
   concatenation) with a backward pass of its own. Where every parameter is a
   plain ``nn.Linear``'s, the NTK takes the layers' inputs and signals as they
   are instead (:mod:`._linear_layers`, :func:`jacobian_pieces`).

For the curvature (:func:`row_chunked_factors`), step 2 sends the rows of the
loss Hessian's square root back a chunk at a time after the one forward, and each
chunk's factors go to the caller's sums before the next chunk's signals exist.

With ``enable_backprop=True`` the signals are computed with ``create_graph=True``, so
the Jacobians are differentiable with respect to the input and the parameters; with
``enable_backprop=False`` step 3 runs under ``torch.no_grad`` and no graph is kept.
Everything runs inside :func:`.model_guard.preserved_state`, so an exception at any
point leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..errors import InvalidInputError
from ._assembly import Factors, Product, assemble
from ._derivatives import (
    check_batch_first,
    owning_modules,
    param_jacobian_factors,
)
from ._elementary import rewritten_modules
from ._forward import recorded_forward
from ._inputs import batch_size, check_model_output, detached
from ._layer_calls import LayerCall
from ._linear_layers import LinearSignals, linear_signals
from ._model_guard import guarded, preserved_state, survey
from ._warnings import quiet_full_backward_hook_warning, quiet_signal_pass

#: Bytes of output signals that :func:`row_chunked_factors` sends back at once:
#: a curvature's rows go back in chunks of this size, never all ``V`` at once
#: unless they fit. On a CIFAR ResNet (batch 128, 100 classes, one thread) the
#: Kronecker factors take as long with 64 MiB as with 256 MiB and half the memory;
#: the diagonal, whose position Grams are formed again for every chunk, asks for
#: a multiple of it (``_curvature``).
ROW_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class JacobianFactors:
    """The per-layer factors of a batch's parameter Jacobians, never assembled.

    Attributes
    ----------
    factors : dict
        ``id(param) -> [factors, ...]`` (:mod:`._assembly`: ``Product``,
        ``Summed``, ``Scattered``, ``Dense``), one entry per module call that uses
        the parameter; parameters without an entry have zero Jacobian columns.
    f : torch.Tensor
        Model output as returned by the model, ``(batch, C)`` or ``(batch,)``.
    n_rows : int
        Rows ``V`` per sample: outputs, or selected outputs.
    batch : int
        Samples ``B``.

    """

    factors: dict[int, list[Factors]]
    f: torch.Tensor
    n_rows: int
    batch: int

    def to(self, dtype: torch.dtype) -> JacobianFactors:
        """The same factors in floating dtype ``dtype`` (indices stay integer)."""
        if self.f.dtype == dtype:
            return self
        cast = {
            key: [_cast(entry, dtype) for entry in entries]
            for key, entries in self.factors.items()
        }
        return JacobianFactors(cast, self.f.to(dtype), self.n_rows, self.batch)

    @staticmethod
    def cat(parts: Sequence[JacobianFactors]) -> JacobianFactors:
        """Factors of consecutive batches of one model, as one batch."""
        first = parts[0]
        factors = {
            key: [
                _cat_entries([p.factors[key][i] for p in parts])
                for i in range(len(entries))
            ]
            for key, entries in first.factors.items()
        }
        f = torch.cat([p.f for p in parts])
        return JacobianFactors(factors, f, first.n_rows, sum(p.batch for p in parts))

    def __getitem__(self, index: torch.Tensor | slice) -> JacobianFactors:
        """The factors of the samples ``index`` selects."""
        factors = {
            key: [_batch_items(e, index) for e in entries]
            for key, entries in self.factors.items()
        }
        f = self.f[index]
        return JacobianFactors(factors, f, self.n_rows, int(f.shape[0]))

    def expanded(self, batch: int) -> JacobianFactors:
        """One sample's factors as ``batch`` samples' shapes, expanded views (no copy).

        For counting what contractions of a larger batch would hold (their shapes
        only); the numbers are the one sample's, repeated.

        Returns
        -------
        JacobianFactors
            Of ``batch`` samples, sharing this one's memory.

        Raises
        ------
        ValueError
            If these factors are not of one sample.
        """
        if self.batch != 1:
            raise ValueError(f"expanded needs one sample's factors, not {self.batch}.")

        def grown(entry: Factors) -> Factors:
            changes: dict[str, Any] = {}
            for name, value in vars(entry).items():
                if isinstance(value, torch.Tensor):
                    shape = list(value.shape)
                    shape[_batch_dim(entry, name)] = batch
                    changes[name] = value.expand(shape)
            return replace(entry, **changes)

        factors = {
            key: [grown(e) for e in entries] for key, entries in self.factors.items()
        }
        f = self.f.expand(batch, *self.f.shape[1:])
        return JacobianFactors(factors, f, self.n_rows, batch)

    @property
    def nbytes(self) -> int:
        """Bytes held by the factors' tensors (a shared tensor counted each time)."""
        return sum(
            t.numel() * t.element_size()
            for entries in self.factors.values()
            for e in entries
            for t in vars(e).values()
            if isinstance(t, torch.Tensor)
        )

    def float_tensors(self) -> list[torch.Tensor]:
        """The factors' floating tensors, in the order :meth:`with_tensors` takes."""
        return [
            value
            for entries in self.factors.values()
            for entry in entries
            for value in vars(entry).values()
            if isinstance(value, torch.Tensor) and value.is_floating_point()
        ]

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> JacobianFactors:
        """The same factors with :meth:`float_tensors` replaced by ``tensors``."""
        supply = iter(tensors)
        factors = {
            key: [_mapped(e, lambda _: next(supply)) for e in entries]
            for key, entries in self.factors.items()
        }
        return JacobianFactors(factors, self.f, self.n_rows, self.batch)

    def detach(self) -> JacobianFactors:
        """The same factors, cut from the graph."""
        factors = {
            key: [_mapped(e, lambda t: t.detach()) for e in entries]
            for key, entries in self.factors.items()
        }
        return JacobianFactors(factors, self.f.detach(), self.n_rows, self.batch)

    def assembled(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The Jacobian ``(batch, V, P)`` of ``params``, in their column order."""
        return assemble(self.factors, params, self.n_rows, self.batch, self.f)


def _mapped(entry: Factors, fn: Callable[[torch.Tensor], torch.Tensor]) -> Factors:
    """``entry`` with ``fn`` applied to each of its floating tensors.

    Its class called with every field (the instance dictionary holds exactly
    them), which costs a third of ``dataclasses.replace``.

    Returns
    -------
    Factors
        Of ``entry``'s class.
    """
    fields: dict[str, Any] = {
        name: (
            fn(value)
            if isinstance(value, torch.Tensor) and value.is_floating_point()
            else value
        )
        for name, value in vars(entry).items()
    }
    return type(entry)(**fields)


def _batch_dim(entry: Factors, name: str) -> int:
    """The sample dimension of ``entry``'s tensor ``name`` (see :mod:`._assembly`)."""
    return 0 if isinstance(entry, Product) or name == "index" else 1


def _batch_items(entry: Factors, index: torch.Tensor | slice) -> Factors:
    changes: dict[str, Any] = {}
    for name, value in vars(entry).items():
        where = (slice(None),) * _batch_dim(entry, name) + (index,)
        changes[name] = value[where]
    return replace(entry, **changes)


def _cast(entry: Factors, dtype: torch.dtype) -> Factors:
    return _mapped(entry, lambda t: t.to(dtype))


def _cat_entries(entries: Sequence[Factors]) -> Factors:
    """One factor from the same module's factors of consecutive batches.

    Batch-first tensors (``Product``'s signals and inputs, ``Scattered``'s index)
    are joined along dimension 0, row-first ones along dimension 1.

    Returns
    -------
    Factors
        The joined factor, of the kind of ``entries[0]``.

    """
    first = entries[0]
    joined: dict[str, Any] = {}
    for name in vars(first):
        dim = _batch_dim(first, name)
        joined[name] = torch.cat([vars(e)[name] for e in entries], dim=dim)
    return replace(first, **joined)


def jacobian_factors(
    model: nn.Module,
    x: torch.Tensor | Mapping,
    params: Sequence[torch.Tensor],
    *,
    root: nn.Module | None = None,
    enable_backprop: bool = False,
    selected_outputs: torch.Tensor | None = None,
) -> JacobianFactors:
    """Per-layer factors of the per-sample Jacobians with respect to ``params``.

    Steps 1 to 3 of the module docstring without the final write of ``J``: what
    :func:`parameter_jacobians` assembles, and what the NTK contracts layer by
    layer (:mod:`laplace_diffjac.kernels`). Arguments as for
    :func:`parameter_jacobians` (the curvature's seeded rows, a chunk at a time:
    :func:`row_chunked_factors`).

    Returns
    -------
    JacobianFactors
        The factors, differentiable with respect to ``x`` and the parameters if
        ``enable_backprop``, else detached.

    """
    pieces = _pieces(
        model, x, params, root, enable_backprop, selected_outputs, linear=False
    )
    assert isinstance(pieces, JacobianFactors)
    return pieces


def jacobian_pieces(
    model: nn.Module,
    x: torch.Tensor | Mapping,
    params: Sequence[torch.Tensor],
    *,
    root: nn.Module | None = None,
    enable_backprop: bool = False,
) -> LinearSignals | JacobianFactors:
    """The Linear layers' inputs and signals where they are all, else the factors.

    One pass, as :func:`jacobian_factors`; where every parameter belongs to an
    ``nn.Linear`` called once on one feature vector per input, its step 3 is
    :func:`._linear_layers.linear_signals`, which the NTK's layer-wise Gram
    takes directly. Arguments as for :func:`jacobian_factors`.

    Returns
    -------
    LinearSignals or JacobianFactors
        Differentiable with respect to ``x`` and the parameters if
        ``enable_backprop``, else detached.

    """
    return _pieces(model, x, params, root, enable_backprop, None, linear=True)


def _pieces(
    model: nn.Module,
    x: torch.Tensor | Mapping,
    params: Sequence[torch.Tensor],
    root: nn.Module | None,
    enable_backprop: bool,
    selected_outputs: torch.Tensor | None,
    linear: bool,
) -> LinearSignals | JacobianFactors:
    """Steps 1 to 3: the Linear layers' signals if ``linear`` and they apply.

    Returns
    -------
    LinearSignals or JacobianFactors
    """
    root = model if root is None else root
    batch = batch_size(x)
    x_in = x if enable_backprop else detached(x)
    surveyed = survey(model)
    with guarded(model, surveyed.plain), torch.enable_grad():
        calls, f, f2 = _checked_forward(
            model, x_in, root, params, batch, graph=enable_backprop
        )
        signals = _output_signals(f2, selected_outputs)
        n_rows = int(signals.shape[0])
        targets = [c.signal_targets() for c in calls]
        # hooks of a user-extended model; vmap's loop for e.g. Bilinear's backward
        quiet = not surveyed.hook_free or n_rows > 1
        with quiet_signal_pass() if quiet else nullcontext():
            flat = _batched_grad(
                f2, [t for ts in targets for t in ts], signals, enable_backprop
            )
        grads = _regroup(flat, targets)
        with torch.set_grad_enabled(enable_backprop):
            result: LinearSignals | JacobianFactors | None = None
            if linear and selected_outputs is None:  # seeds: the identity
                result = linear_signals(calls, grads, params, f, n_rows, batch)
            if result is None:
                factors = param_jacobian_factors(calls, grads, params)
                result = JacobianFactors(factors, f, n_rows, batch)
    # The recorded layer inputs hang on the forward's graph through the
    # parameters: cut every factor, not only the output, for every caller.
    return result if enable_backprop else result.detach()


def row_chunked_factors(
    model: nn.Module,
    x: torch.Tensor | Mapping,
    params: Sequence[torch.Tensor],
    seeds: Callable[[torch.Tensor], torch.Tensor],
    consume: Callable[[JacobianFactors], None],
    *,
    root: nn.Module | None = None,
    chunk_bytes: int | None = None,
    chunk_scale: int = 1,
) -> torch.Tensor:
    """The factors of ``seeds``' rows, a few rows at a time, from one forward pass.

    The rows of a curvature are summed over (the GGN is ``Σ_v ρ_v ρ_vᵀ``), so a
    caller that accumulates its sums needs the signals of only a few rows at once:
    one forward pass records the module calls, then the rows go back in chunks
    whose signals at the recorded outputs take at most ``chunk_bytes`` (at least
    one row), each chunk's factors are handed to ``consume`` and freed before the
    next chunk's backward. Detached, as :func:`jacobian_factors` without
    ``enable_backprop``, and inside :func:`.model_guard.preserved_state`, so an
    exception in ``consume`` too leaves the model as it was.

    Parameters
    ----------
    model, x, params, root
        As for :func:`jacobian_factors`.
    seeds : callable
        Maps the detached model output ``(batch, C)`` to the rows to
        differentiate, ``(V, batch, C)``: row ``v`` of sample ``b`` is
        ``seeds[v, b] · J_b`` (a square root of the loss Hessian for the GGN, the
        loss gradient for the empirical Fisher).
    consume : callable
        Called with each chunk's :class:`JacobianFactors` (``n_rows`` its rows), in
        the order of the rows.
    chunk_bytes : int, optional
        Bytes of output signals one chunk may hold; :data:`ROW_CHUNK_BYTES` by
        default.
    chunk_scale : int, default=1
        ``chunk_bytes`` times this (a caller's multiple of the default).

    Returns
    -------
    torch.Tensor
        The detached model output, ``(batch, C)`` or ``(batch,)``.

    """
    root = model if root is None else root
    batch = batch_size(x)
    with preserved_state(model), torch.enable_grad():
        calls, f, f2 = _checked_forward(model, detached(x), root, params, batch)
        signals = seeds(f2.detach())
        targets = [c.signal_targets() for c in calls]
        flat_targets = [t for ts in targets for t in ts]
        per_row = sum(t.numel() * t.element_size() for t in flat_targets)
        budget = ROW_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        step = max(1, budget * chunk_scale // max(1, per_row))
        for start in range(0, int(signals.shape[0]), step):
            chunk = signals[start : start + step]
            with quiet_signal_pass():
                flat = _batched_grad(f2, flat_targets, chunk, False)
            with torch.no_grad():
                factors = param_jacobian_factors(calls, _regroup(flat, targets), params)
            del flat
            parts = JacobianFactors(factors, f, int(chunk.shape[0]), batch)
            del factors
            consume(parts.detach())
            del parts
    return f.detach()


def _checked_forward(
    model: nn.Module,
    x: torch.Tensor | Mapping,
    root: nn.Module,
    params: Sequence[torch.Tensor],
    batch: int,
    graph: bool = False,
) -> tuple[list[LayerCall], torch.Tensor, torch.Tensor]:
    """Step 1: the recorded forward pass, its output and calls checked.

    Runs inside the caller's :func:`.model_guard.preserved_state` with gradients
    enabled; the modules owning ``params`` run in their elementary forms where
    their fused kernels differentiate wrongly (:mod:`._elementary`), and with
    ``graph`` (the caller keeps the Jacobians' graph) the piecewise-linear
    activations and max pooling too.

    Returns
    -------
    calls : list
        The recorded module calls (:mod:`._layer_calls`).
    f : torch.Tensor
        The model output, ``(batch, C)`` or ``(batch,)``.
    f2 : torch.Tensor
        ``f`` as ``(batch, C)``.

    """
    modules = owning_modules(root, params)
    rewritten = rewritten_modules(model, modules, graph)
    calls, f = recorded_forward(model, x, modules, rewritten, batch)
    f = check_model_output(f, batch)
    check_batch_first(calls, batch, root)
    return calls, f, f if f.dim() == 2 else f.unsqueeze(1)


def parameter_jacobians(
    model: nn.Module,
    x: torch.Tensor | Mapping,
    params: Sequence[torch.Tensor],
    *,
    root: nn.Module | None = None,
    enable_backprop: bool = False,
    selected_outputs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample Jacobians of the model outputs with respect to ``params``.

    Parameters
    ----------
    model : torch.nn.Module
        Model called as ``model(x)``; must return ``(batch, C)`` or ``(batch,)``.
    x : torch.Tensor or Mapping
        Input batch ``(batch, *input_shape)``, or a dict-like batch whose tensors
        share the leading batch dimension (the model is called with the mapping
        itself, as laplace-torch does); already validated.
    params : sequence of torch.Tensor
        Parameters, in the column order of the result.
    root : torch.nn.Module, optional
        Submodule that owns ``params`` (``model`` by default; the last layer for
        last-layer Laplace).
    enable_backprop : bool, default=False
        Keep the results connected to the graph of ``x`` and the parameters.
    selected_outputs : torch.Tensor, optional
        Integer indices ``(batch, S)``: differentiate only output
        ``selected_outputs[n, s]`` of sample ``n`` in row ``s``.

    Returns
    -------
    Js : torch.Tensor
        ``(batch, C, P)``, or ``(batch, S, P)`` with ``selected_outputs``.
    f : torch.Tensor
        Model output as returned by the model, ``(batch, C)`` or ``(batch,)``.

    """
    parts = jacobian_factors(
        model,
        x,
        params,
        root=root,
        enable_backprop=enable_backprop,
        selected_outputs=selected_outputs,
    )
    with torch.set_grad_enabled(enable_backprop):
        Js = parts.assembled(params)
    if not enable_backprop:
        return Js.detach(), parts.f
    return Js, parts.f


def per_sample_gradients(
    model: nn.Module,
    x: torch.Tensor | Mapping,
    loss_of_output: Callable[[torch.Tensor], torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    root: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of a sum-reduced loss with respect to ``params``.

    Parameters
    ----------
    model : torch.nn.Module
        Model called as ``model(x)``.
    x : torch.Tensor or Mapping
        Input batch ``(batch, *input_shape)`` or a dict-like batch.
    loss_of_output : callable
        Maps the model output to the scalar loss, a sum over samples.
    params : sequence of torch.Tensor
        Parameters, in the column order of the result.
    root : torch.nn.Module, optional
        Submodule that owns ``params``.

    Returns
    -------
    Gs : torch.Tensor
        ``(batch, P)``, detached.
    loss : torch.Tensor
        The scalar loss, detached.

    """
    root = model if root is None else root
    modules = owning_modules(root, params)
    batch = batch_size(x)
    with preserved_state(model), torch.enable_grad():
        # the elementary forms too: the same derivatives as the Jacobians'
        rewritten = rewritten_modules(model, modules)
        calls, f = recorded_forward(model, detached(x), modules, rewritten, batch)
        check_batch_first(calls, batch, root)
        loss = loss_of_output(f)
        targets = [c.signal_targets() for c in calls]
        with quiet_full_backward_hook_warning():
            flat = torch.autograd.grad(
                loss, [t for ts in targets for t in ts], allow_unused=True
            )
        with torch.no_grad():
            signals = _regroup(
                [None if g is None else g.unsqueeze(0) for g in flat], targets
            )
            factors = param_jacobian_factors(calls, signals, params)
            Gs = assemble(factors, params, 1, batch, f)[:, 0]
    return Gs.detach(), loss.detach()


def _regroup(
    flat: Sequence[torch.Tensor | None], targets: Sequence[Sequence[torch.Tensor]]
) -> list[tuple[torch.Tensor | None, ...]]:
    """Split the flat list of signals back into one tuple per module call."""
    grouped, start = [], 0
    for ts in targets:
        grouped.append(tuple(flat[start : start + len(ts)]))
        start += len(ts)
    return grouped


def _output_signals(f: torch.Tensor, selected: torch.Tensor | None) -> torch.Tensor:
    """Return the batched gradient seeds ``(V, batch, C)`` for ``f`` ``(batch, C)``."""
    batch, n_out = f.shape
    if selected is None:
        eye = torch.eye(n_out, dtype=f.dtype, device=f.device)
        return eye.unsqueeze(1).expand(n_out, batch, n_out)
    selected = selected.to(device=f.device, dtype=torch.long)
    if selected.dim() == 1:
        selected = selected[:, None]
    if selected.shape[0] != batch:
        raise InvalidInputError(
            f"Output selectors have {selected.shape[0]} rows but the batch has "
            f"{batch}; pass one row of output indices per input."
        )
    if selected.numel() and (selected.min() < 0 or selected.max() >= n_out):
        raise InvalidInputError(
            f"Output selectors must lie in [0, {n_out}) (the model has {n_out} "
            "outputs)."
        )
    one_hot = torch.nn.functional.one_hot(selected, n_out).to(f.dtype)
    return one_hot.permute(1, 0, 2)


def _batched_grad(
    f: torch.Tensor,
    outputs: list[torch.Tensor],
    signals: torch.Tensor,
    create_graph: bool,
) -> list[torch.Tensor | None]:
    """Vector-Jacobian products of ``f`` for every seed in ``signals`` at once.

    One seed (a model with one output, or one output selected) is one
    ``autograd.grad``: batching it would only add ``vmap``'s per-call overhead.
    Otherwise ``torch.func.vmap`` over ``autograd.grad`` first: it has batching
    rules for the backward kernels of LayerNorm and softmax, which
    ``is_grads_batched`` (the legacy vmap prototype) runs seed by seed, leaving a
    graph of V small pieces that makes the double backward several times slower.
    Then ``is_grads_batched``, then one pass per seed, for graphs (or user hooks)
    that one of them cannot batch.

    Returns
    -------
    list of (torch.Tensor or None)
        One ``(V, *output.shape)`` tensor per entry of ``outputs``; ``None`` where
        the output does not influence ``f``.

    """
    if not outputs:
        return []
    kwargs = {"retain_graph": True, "create_graph": create_graph, "allow_unused": True}
    if signals.shape[0] == 1:  # one seed (a single output): no batching to do
        grads = torch.autograd.grad(f, outputs, signals[0], **kwargs)
        return [None if g is None else g.unsqueeze(0) for g in grads]
    try:
        return _func_vmap_grad(f, outputs, signals, kwargs)
    except (RuntimeError, NotImplementedError, ValueError):
        pass
    try:
        grads = torch.autograd.grad(
            f, outputs, signals, is_grads_batched=True, **kwargs
        )
        return list(grads)
    except RuntimeError:
        per_seed = [torch.autograd.grad(f, outputs, seed, **kwargs) for seed in signals]
        return [
            None if column[0] is None else torch.stack(column)
            for column in zip(*per_seed)
        ]


def _func_vmap_grad(
    f: torch.Tensor,
    outputs: list[torch.Tensor],
    signals: torch.Tensor,
    kwargs: dict[str, bool],
) -> list[torch.Tensor | None]:
    """``autograd.grad`` under ``torch.func.vmap`` over the seeds ``(V, *f.shape)``."""
    unused: list[int] = []  # filled while vmap traces the function once

    def vjp(seed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grads = torch.autograd.grad(f, outputs, seed, **kwargs)
        unused.extend(i for i, g in enumerate(grads) if g is None)
        return tuple(g for g in grads if g is not None)

    used = iter(torch.func.vmap(vjp)(signals))
    return [None if i in unused else next(used) for i in range(len(outputs))]
