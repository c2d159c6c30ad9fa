"""Independent references the tests compare against.

:func:`loop_jacobians` is the primary reference: one ``torch.autograd.grad`` per
sample and output, no ``torch.func``, so it shares no batching rule with either
backend. :func:`central_difference` checks what is differentiated through the
Jacobians without any double backward. :func:`reference_jacobians`
(``vmap(jacrev)``, the same computation as ``DiffFuncGGN``) is a second reference,
never the only one. Nothing here imports ``laplace_diffjac``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel


def reference_jacobians(
    model: nn.Module,
    x: torch.Tensor | Mapping[str, torch.Tensor],
    params: Sequence[torch.Tensor] | None = None,
    *,
    loop: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``vmap(jacrev(functional_call))``: ``(batch, C, P)``, ``(batch, C)``.

    Differentiable with respect to ``x`` and the parameters by ordinary autograd.
    ``x`` may be a dict of tensors sharing the batch dimension (the model is
    called with a dict). With ``loop=True`` plain autograd is used instead of
    ``torch.func``: one ``torch.autograd.grad`` per sample and output with
    ``create_graph=True``: for recurrent layers, which ``vmap`` cannot batch, and
    for layer and group normalisation, whose second derivatives through
    ``vmap(jacrev)`` are wrong in torch 2.14 (differentiating the Jacobian of
    ``Linear -> LayerNorm -> Linear`` disagrees with finite differences).
    """
    chosen = list(model.parameters()) if params is None else list(params)
    with _composite_attention():
        if loop:
            return _autograd_loop(model, x, chosen)
        return _vmap_jacrev(model, x, chosen)


def loop_jacobians(
    model: nn.Module,
    x: torch.Tensor | Mapping[str, torch.Tensor],
    params: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample, per-output ``autograd.grad``: ``(batch, C, P)``, ``(batch, C)``.

    The model is called on one sample at a time (a batch of one), and every output
    is differentiated on its own with ``create_graph=True``, so the result is
    differentiable with respect to ``x`` and the parameters. No ``vmap``.
    """
    chosen = list(model.parameters()) if params is None else list(params)
    with reference_forward(model):
        return _autograd_loop(model, x, chosen)


@contextmanager
def reference_forward(model: nn.Module):
    """The forward every loop reference runs: composite attention, exact Hardsigmoid.

    Attention by its math kernels (no fused fast path) and ``nn.Hardsigmoid`` as
    ``relu6(x + 3) / 6`` (see :func:`_exact_hardsigmoid`), for the duration of the
    block; what :func:`loop_jacobians` differentiates.
    """
    with _composite_attention(), _exact_hardsigmoid(model):
        yield


def central_difference(
    fn: Callable[[float], torch.Tensor], step: float = 1e-5
) -> torch.Tensor:
    """``(fn(step) - fn(-step)) / (2 step)``: the derivative of ``fn`` at 0.

    ``fn`` maps a scalar offset along a fixed direction to a scalar; the result
    approximates its directional derivative to ``O(step**2)`` without any
    autograd through ``fn``.
    """
    return ((fn(step) - fn(-step)) / (2 * step)).detach()


def _vmap_jacrev(model, x, chosen):
    ids = {id(p) for p in chosen}
    named = {n: p for n, p in model.named_parameters() if id(p) in ids}

    def single(p, xi):
        xi = {k: v.unsqueeze(0) for k, v in xi.items()} if _is_map(xi) else xi[None]
        out = functional_call(model, p, (xi,), strict=False)
        return out.reshape(-1)

    def jac_and_out(p, xi):
        return jacrev(lambda q: (single(q, xi), single(q, xi)), has_aux=True)(p)

    jac, f = vmap(jac_and_out, in_dims=(None, 0))(named, x)
    Js = torch.cat([j.flatten(start_dim=2) for j in jac.values()], dim=2)
    return Js, f


def _autograd_loop(model, x, chosen):
    n = len(next(iter(x.values()))) if _is_map(x) else len(x)
    rows, outs = [], []
    for i in range(n):
        xi = {k: v[i : i + 1] for k, v in x.items()} if _is_map(x) else x[i : i + 1]
        out = model(xi).reshape(-1)
        jac = []
        for c in range(out.shape[0]):
            grads = torch.autograd.grad(
                out[c], chosen, create_graph=True, allow_unused=True
            )
            jac.append(
                torch.cat(
                    [
                        (torch.zeros_like(p) if g is None else g).flatten()
                        for g, p in zip(grads, chosen)
                    ]
                )
            )
        rows.append(torch.stack(jac))
        outs.append(out)
    return torch.stack(rows), torch.stack(outs)


@contextmanager
def _exact_hardsigmoid(model: nn.Module):
    """``nn.Hardsigmoid`` as ``relu6(x + 3) / 6`` inside the block.

    The same values as PyTorch's kernel, whose derivative in float64 is float32's
    1/6 (off by 3e-8 relative; pinned in ``tests/backends/test_upstream_pins.py``),
    too coarse for a 1e-10 reference. Forward hooks that live for the block;
    in-place ``Hardsigmoid`` is not covered (its input is gone when the hook runs).
    """

    def exact(module, inputs, output):
        assert not module.inplace, "the reference needs Hardsigmoid(inplace=False)"
        return torch.nn.functional.relu6(inputs[0] + 3) / 6

    handles = [
        m.register_forward_hook(exact)
        for m in model.modules()
        if isinstance(m, nn.Hardsigmoid)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _composite_attention():
    """Attention by its composite (math) kernels, without the fused fast path."""
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)


def _is_map(x: object) -> bool:
    return isinstance(x, Mapping)


def model_state(model: nn.Module) -> dict:
    """Everything of a model the backends promise not to change, for comparison."""
    state = {}
    for name, module in model.named_modules():
        state[f"module:{name}:attrs"] = {
            k: (v if isinstance(v, (bool, int, float, str, type(None))) else id(v))
            for k, v in vars(module).items()
            if not isinstance(v, dict)
        }
        for hooks in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        ):
            state[f"module:{name}:{hooks}"] = list(getattr(module, hooks).items())
        state[f"module:{name}:training"] = module.training
    for name, p in model.named_parameters():
        state[f"param:{name}:grad"] = None if p.grad is None else p.grad.clone()
        state[f"param:{name}:grad_id"] = id(p.grad)
        state[f"param:{name}:attrs"] = sorted(vars(p))
        state[f"param:{name}:value"] = p.detach().clone()
    for name, b in model.named_buffers():
        state[f"buffer:{name}"] = b.detach().clone()
    return state


def assert_same_state(before: dict, after: dict) -> None:
    """Assert two :func:`model_state` snapshots are identical, bit for bit."""
    assert before.keys() == after.keys()
    for key in before:
        a, b = before[key], after[key]
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), key
            assert torch.equal(a, b), key
        else:
            assert a == b, f"{key}: {a!r} != {b!r}"
