"""One measurement in a fresh process: ``python worker.py SPEC_JSON`` (by run.py).

Prints one line ``RESULT {json}`` per method of the spec. Tasks:

``jacobian``
    One Jacobian route on one configuration: peak memory of the full step
    (Jacobians + gradient of the objective w.r.t. x; first, before anything else
    runs), and the relative error of J and of the x-gradient against float64.
``timing``
    All Jacobian routes of one configuration in one process, timed in turn round
    after round: median times of the Jacobians alone, of the full step and of the
    objective alone.
``gram``
    One NTK Gram route (``J``: DiffBackPackGGN Jacobians + einsum; ``structured``:
    :func:`laplace_diffjac.kernels.structured_ntk`; ``kernel``:
    ``laplace_diffjac.kernels.ntk``): peak memory and median time of the Gram and of
    Gram + gradient w.r.t. x of its trace, and the error against float64.

Each spec names its ``device`` (default ``cpu``; models, inputs and the float64
reference go there) and its ``allocator`` setting (:mod:`allocator`; the process
was started in its environment by ``run.py``, and ``mmap-off`` is applied here).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from allocator import applied  # noqa: E402
from cases import Config, to_device  # noqa: E402
from measure import (  # noqa: E402
    interleaved_seconds,
    median_seconds,
    peak_mib,
    start_peak,
    synchronized,
)
from methods import JACOBIAN_METHODS, reference_jacobians  # noqa: E402

#: Above this many flops for J Jᵀ, the full step uses the trace objective.
LOGDET_FLOP_LIMIT = 1e9

CPU = torch.device("cpu")


def objective_kind(batch: int, n_out: int, n_params: int) -> str:
    """``'logdet'`` (logdet(I + J Jᵀ) on the (B·C)² Gram) or ``'trace'`` (tr J Jᵀ)."""
    flops = (batch * n_out) ** 2 * n_params
    return "logdet" if flops <= LOGDET_FLOP_LIMIT else "trace"


def objective(J: torch.Tensor, kind: str) -> torch.Tensor:
    """NTK objective of Jacobians ``(B, C, P)``: a scalar."""
    flat = J.reshape(-1, J.shape[-1])
    if kind == "trace":
        return flat.pow(2).sum()
    gram = flat @ flat.T
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.logdet(eye + gram)


def jacobian_part(t_full: float, t_obj: float) -> float | None:
    """Full step minus the objective alone; ``None`` if noise made it non-positive."""
    return t_full - t_obj if t_full > t_obj else None


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def _timing_args(quick: bool, budget_s: float = 1.0, max_reps: int = 10) -> dict:
    if quick:
        return {"budget_s": 0.0, "min_reps": 1, "max_reps": 1}
    return {"budget_s": budget_s, "min_reps": 3, "max_reps": max_reps}


def _leaves(model: torch.nn.Module, x) -> list[torch.Tensor]:
    """What the full step differentiates: ``x``, or the parameters for tokens."""
    return list(model.parameters()) if isinstance(x, dict) else [x]


def _full_step(jac, x, kind: str, leaves: list[torch.Tensor]):
    """Jacobians + gradient of the objective with respect to ``leaves``."""

    def full() -> torch.Tensor:
        grads = torch.autograd.grad(objective(jac(x), kind), leaves, allow_unused=True)
        return torch.cat(
            [
                (torch.zeros_like(p) if g is None else g).flatten()
                for g, p in zip(grads, leaves)
            ]
        )

    return full


def _input(cfg: Config, device: torch.device):
    x = to_device(cfg.inputs(), device)
    return x if isinstance(x, dict) else x.requires_grad_(True)


def run_jacobian(
    cfg: Config, method: str, quick: bool, device: torch.device = CPU
) -> dict:
    """Peak memory of one full step (first thing in a fresh process) and errors."""
    model = cfg.model().to(device)
    x = _input(cfg, device)
    jac = JACOBIAN_METHODS[method](model, cfg.n_out)
    n_params = sum(p.numel() for p in model.parameters())
    kind = objective_kind(cfg.batch, cfg.n_out, n_params)
    full = synchronized(_full_step(jac, x, kind, _leaves(model, x)), device)

    base = start_peak(device)
    t0 = time.perf_counter()
    gx = full()
    t_first = time.perf_counter() - t0
    peak = peak_mib(device) - base

    model64 = cfg.model(torch.float64).to(device)
    if isinstance(x, dict):  # token batches: check on 8 samples (slow reference)
        x = {k: v[:8] for k, v in x.items()}
        gx = _full_step(jac, x, kind, _leaves(model, x))()
    J = jac(x)
    x64 = x if isinstance(x, dict) else x.detach().double().requires_grad_(True)
    ref = reference_jacobians(model64, x64)
    ref_g = _full_step(lambda _: ref, x64, kind, _leaves(model64, x64))()
    return {
        "n_params": n_params,
        "objective": kind,
        "t_first": t_first,
        "peak_mib": peak,
        "base_mib": base,
        "rel_err_J": _rel(J.detach(), ref.detach()),
        "rel_err_grad_x": _rel(gx.detach(), ref_g.detach()),
    }


def run_timing(
    cfg: Config, methods: list[str], quick: bool, device: torch.device = CPU
) -> dict[str, dict]:
    """Interleaved median times of every method on one configuration.

    The methods run in turn, round after round, in one process, so that a slow
    spell of the machine hits all of them alike; the objective alone (on a
    detached J, the same for every method) is timed in the same rounds and
    subtracted from each full step to give the Jacobian part.
    """
    model = cfg.model().to(device)
    x = _input(cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    kind = objective_kind(cfg.batch, cfg.n_out, n_params)
    jacs = {m: JACOBIAN_METHODS[m](model, cfg.n_out) for m in methods}
    Jd = jacs[methods[-1]](x).detach().requires_grad_(True)
    tasks: dict[tuple[str, str], Callable[[], object]] = {
        ("objective", "t_obj"): lambda: torch.autograd.grad(objective(Jd, kind), Jd)
    }
    for m, jac in jacs.items():
        tasks[(m, "t_jac")] = lambda jac=jac: jac(x)
        tasks[(m, "t_full")] = _full_step(jac, x, kind, _leaves(model, x))
    tasks = {key: synchronized(fn, device) for key, fn in tasks.items()}
    for fn in tasks.values():  # warm-up
        fn()
    times = interleaved_seconds(tasks, **_timing_args(quick, 1.0, 15))
    t_obj = times[("objective", "t_obj")][0]
    out: dict[str, dict] = {}
    for m in methods:
        t_full, reps = times[(m, "t_full")]
        out[m] = {
            "t_jac": times[(m, "t_jac")][0],
            "t_full": t_full,
            "t_obj": t_obj,
            "t_jac_part": jacobian_part(t_full, t_obj),
            "reps": reps,
        }
    return out


def _gram_fn(route: str, model: torch.nn.Module):
    if route == "structured":
        from laplace_diffjac.kernels import structured_ntk

        return lambda x: structured_ntk(model, x)
    from laplace_diffjac import DiffBackPackGGN

    backend = DiffBackPackGGN(model, "classification")
    if route == "kernel":
        from laplace_diffjac.kernels import ntk

        return lambda x: ntk(backend, x)

    def via_jacobians(x: torch.Tensor) -> torch.Tensor:
        J = backend.jacobians(x, enable_backprop=True)[0]
        return torch.einsum("bcp,dep->bdce", J, J)

    return via_jacobians


def run_gram(cfg: Config, route: str, quick: bool, device: torch.device = CPU) -> dict:
    model = cfg.model().to(device)
    x = cfg.inputs().to(device).requires_grad_(True)
    gram = _gram_fn(route, model)
    n_params = sum(p.numel() for p in model.parameters())

    def full() -> torch.Tensor:
        K = gram(x)
        return torch.autograd.grad(torch.einsum("bbcc->", K), x)[0]

    base = start_peak(device)
    synchronized(full, device)()
    peak = peak_mib(device) - base
    timing = _timing_args(quick)
    t_gram, reps = median_seconds(synchronized(lambda: gram(x), device), **timing)
    t_full, _ = median_seconds(synchronized(full, device), **timing)

    K = gram(x).detach()
    sub = min(cfg.batch, 32)
    model64 = cfg.model(torch.float64).to(device)
    ref = reference_jacobians(model64, x[:sub].detach().double())
    ref_K = torch.einsum("bcp,dep->bdce", ref, ref)
    return {
        "n_params": n_params,
        "t_gram": t_gram,
        "t_full": t_full,
        "reps": reps,
        "peak_mib": peak,
        "base_mib": base,
        "rel_err_K": _rel(K[:sub, :sub], ref_K),
    }


def main(spec: dict) -> list[dict]:
    """Run the measurements of ``spec`` (one per entry of ``spec['methods']``).

    Full runs give one method per process for ``jacobian`` and ``gram`` (isolated
    peak memory) and one process per configuration for ``timing``; ``--quick``
    batches a configuration's methods into one process.
    """
    warnings.filterwarnings("ignore")
    with applied(spec.get("allocator", "default")):
        if spec["task"] == "timing":
            return _measure_timing(spec)
        return [_measure(spec, method) for method in spec["methods"]]


def _labels(spec: dict) -> dict:
    """What every result of ``spec`` records besides its measurements."""
    return {
        "allocator": spec.get("allocator", "default"),
        "device": spec.get("device", "cpu"),
    }


def _measure_timing(spec: dict) -> list[dict]:
    cfg = Config(**spec["config"])
    base = {"config": cfg.name, "task": "timing", **_labels(spec)}
    device = torch.device(spec.get("device", "cpu"))
    try:
        times = run_timing(cfg, spec["methods"], spec.get("quick", False), device)
    except Exception as exc:  # reported in the table, not raised
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"[:300]
        return [
            {**base, "method": m, "ok": False, "error": error} for m in spec["methods"]
        ]
    return [{**base, "method": m, "ok": True, **times[m]} for m in spec["methods"]]


def _measure(spec: dict, method: str) -> dict:
    cfg = Config(**spec["config"])
    task, quick = spec["task"], spec.get("quick", False)
    device = torch.device(spec.get("device", "cpu"))
    result = {
        "config": cfg.name,
        "task": task,
        "method": method,
        "quick": quick,
        "ok": True,
        **_labels(spec),
    }
    try:
        if task == "jacobian":
            result.update(run_jacobian(cfg, method, quick, device))
        else:
            result.update(run_gram(cfg, method, quick, device))
    except Exception as exc:  # reported in the table, not raised
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        traceback.print_exc()
    return result


if __name__ == "__main__":
    for out in main(json.loads(sys.argv[1])):
        print("RESULT " + json.dumps(out), flush=True)
