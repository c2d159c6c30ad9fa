"""One measurement in a fresh process: ``python benchmarks/worker.py SPEC_JSON``.

Prints one line ``RESULT {json}`` per method of the spec. Tasks:

``jacobian``
    One Jacobian route on one configuration: peak memory of the full step (first,
    before anything else runs), median times of the Jacobians alone, of the full
    step (Jacobians + gradient of the objective w.r.t. x) and of the objective
    alone, and the relative error of J and of the x-gradient against float64.
``gram``
    One NTK Gram route (``J``: DiffBackPackGGN Jacobians + einsum; ``structured``:
    :func:`laplace_diffjac.structured_ntk.structured_ntk`; ``kernel``:
    ``laplace_diffjac.kernel.ntk``): peak memory and median time of the Gram and of
    Gram + gradient w.r.t. x of its trace, and the error against float64.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from cases import Config  # noqa: E402
from measure import (  # noqa: E402
    current_rss_mib,
    median_seconds,
    peak_rss_mib,
    reset_peak_rss,
)
from methods import JACOBIAN_METHODS, reference_jacobians  # noqa: E402

#: Above this many flops for J Jᵀ, the full step uses the trace objective.
LOGDET_FLOP_LIMIT = 1e9


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


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def _timing_args(quick: bool) -> dict:
    if quick:
        return {"budget_s": 0.0, "min_reps": 1, "max_reps": 1}
    return {"budget_s": 1.0, "min_reps": 3, "max_reps": 10}


def run_jacobian(cfg: Config, method: str, quick: bool) -> dict:
    model = cfg.model()
    x = cfg.inputs().requires_grad_(True)
    jac = JACOBIAN_METHODS[method](model, cfg.n_out)
    n_params = sum(p.numel() for p in model.parameters())
    kind = objective_kind(cfg.batch, cfg.n_out, n_params)

    def full() -> torch.Tensor:
        return torch.autograd.grad(objective(jac(x), kind), x)[0]

    base = current_rss_mib()
    reset_peak_rss()
    full()
    peak = peak_rss_mib() - base

    timing = _timing_args(quick)
    t_jac, reps = median_seconds(lambda: jac(x), **timing)
    t_full, _ = median_seconds(full, **timing)
    J = jac(x)
    Jd = J.detach().requires_grad_(True)
    t_obj, _ = median_seconds(
        lambda: torch.autograd.grad(objective(Jd, kind), Jd), **timing
    )

    gx = full()
    x64 = x.detach().double().requires_grad_(True)
    ref = reference_jacobians(cfg.model(torch.float64), x64)
    ref_g = torch.autograd.grad(objective(ref, kind), x64)[0]
    return {
        "n_params": n_params,
        "objective": kind,
        "t_jac": t_jac,
        "t_full": t_full,
        "t_obj": t_obj,
        "t_jac_part": max(t_full - t_obj, 0.0),
        "reps": reps,
        "peak_mib": peak,
        "base_mib": base,
        "rel_err_J": _rel(J.detach(), ref.detach()),
        "rel_err_grad_x": _rel(gx.detach(), ref_g.detach()),
    }


def _gram_fn(route: str, model: torch.nn.Module):
    if route == "structured":
        from laplace_diffjac.structured_ntk import structured_ntk

        return lambda x: structured_ntk(model, x)
    from laplace_diffjac import DiffBackPackGGN

    backend = DiffBackPackGGN(model, "classification")
    if route == "kernel":
        from laplace_diffjac.kernel import ntk

        return lambda x: ntk(backend, x)

    def via_jacobians(x: torch.Tensor) -> torch.Tensor:
        J = backend.jacobians(x, enable_backprop=True)[0]
        return torch.einsum("bcp,dep->bdce", J, J)

    return via_jacobians


def run_gram(cfg: Config, route: str, quick: bool) -> dict:
    model = cfg.model()
    x = cfg.inputs().requires_grad_(True)
    gram = _gram_fn(route, model)
    n_params = sum(p.numel() for p in model.parameters())

    def full() -> torch.Tensor:
        K = gram(x)
        return torch.autograd.grad(torch.einsum("bbcc->", K), x)[0]

    base = current_rss_mib()
    reset_peak_rss()
    full()
    peak = peak_rss_mib() - base
    timing = _timing_args(quick)
    t_gram, reps = median_seconds(lambda: gram(x), **timing)
    t_full, _ = median_seconds(full, **timing)

    K = gram(x).detach()
    sub = min(cfg.batch, 32)
    ref = reference_jacobians(cfg.model(torch.float64), x[:sub].detach().double())
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

    Full runs give one method per process; ``--quick`` batches a configuration's
    methods into one process (its memory figures are then not isolated).
    """
    warnings.filterwarnings("ignore")
    return [_measure(spec, method) for method in spec["methods"]]


def _measure(spec: dict, method: str) -> dict:
    cfg = Config(**spec["config"])
    task, quick = spec["task"], spec.get("quick", False)
    result = {"config": cfg.name, "task": task, "method": method, "ok": True}
    try:
        if task == "jacobian":
            result.update(run_jacobian(cfg, method, quick))
        else:
            result.update(run_gram(cfg, method, quick))
    except Exception as exc:  # reported in the table, not raised
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        traceback.print_exc()
    return result


if __name__ == "__main__":
    for out in main(json.loads(sys.argv[1])):
        print("RESULT " + json.dumps(out), flush=True)
