"""Where ``DiffBackPackGGN``'s curvature spends its time: one batch, by phase.

Seconds of each phase of the engine's curvature on one batch of the CIFAR ResNet
of ``curvature_routes.py``: the recorded forward, the backward passes of the
rows (all chunks), the per-module rules that turn signals into factors, and the
sums (the diagonal's contraction, or the Kronecker factors' Grams), with the
total and the peak resident memory above the resident memory before it (Linux).
The phases are timed by wrapping the engine's functions for the duration of the
run; nothing else changes.

Run: ``python benchmarks/curvature/profile_phases.py [--model resnet-nobn]
[--structure diag] [--batch 128] [--threads 2] [--quick]``; printed (``--quick``:
a batch of two).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from curvature_routes import MODELS, batches, build, classes


@contextmanager
def timed(module: Any, name: str, phase: str, seconds: dict[str, float]):
    """``module.name`` wrapped so that its calls add their seconds to ``phase``."""
    original: Callable = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, original)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def profile(model_name: str, structure: str, batch: int) -> dict[str, float]:
    """Seconds per phase, total seconds and peak GiB of one batch's curvature."""
    from torch import nn

    from laplace_diffjac.jacobians import _curvature, _engine, _kronecker

    model = build(model_name)
    (x, y), *_ = batches(batch, batch, classes(model_name))
    params = list(model.parameters())
    loss = nn.CrossEntropyLoss(reduction="sum")
    if structure == "diag":
        run = _curvature.ggn_diagonal
        sums: tuple[Any, str] = (_curvature, "factor_ggn_diagonal")
    else:
        run = _curvature.ggn_kronecker_factors
        sums = (_kronecker.KroneckerSums, "add")
    run(model, model, loss, x[:2], y[:2], params)  # warm-up
    seconds: dict[str, float] = {}
    with (
        timed(_engine, "recorded_forward", "forward", seconds),
        timed(_engine, "_batched_grad", "backward", seconds),
        timed(_engine, "param_jacobian_factors", "rules", seconds),
        timed(*sums, "sums", seconds),
    ):
        Path("/proc/self/clear_refs").write_text("5")
        base = _rss_kib("VmRSS")
        start = time.perf_counter()
        run(model, model, loss, x, y, params)
        seconds["total"] = time.perf_counter() - start
        seconds["peak_gib"] = max(_rss_kib("VmHWM") - base, 0) / 2**20
    return seconds


def main() -> None:
    """Parse the options and print the phases."""
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=MODELS[0], choices=MODELS)
    parser.add_argument("--structure", default="diag", choices=["diag", "kron"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch = 2 if args.quick else args.batch
    result = profile(args.model, args.structure, batch)
    print(f"{args.model} {args.structure}, batch {batch}, {args.threads} thread(s)")
    for phase, value in result.items():
        unit = "GiB" if phase == "peak_gib" else "s"
        print(f"  {phase:10s} {value:8.3f} {unit}")


if __name__ == "__main__":
    main()
