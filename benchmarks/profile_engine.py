"""Where the time of one Jacobian route goes: ``python benchmarks/profile_engine.py``.

Prints torch.profiler's operator table of the full step (Jacobians + gradient of
``‖J‖²`` w.r.t. x), e.g. ``--config mlp,512,10,32 --method DiffBackPackGGN``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from cases import Config  # noqa: E402
from methods import JACOBIAN_METHODS  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="mlp,512,10,32", help="kind,width,C,B")
    parser.add_argument("--method", default="DiffBackPackGGN")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args(argv)
    kind, width, n_out, batch = args.config.split(",")
    cfg = Config(kind, int(width), int(n_out), int(batch))
    warnings.filterwarnings("ignore")
    model, x = cfg.model(), cfg.inputs().requires_grad_(True)
    jac = JACOBIAN_METHODS[args.method](model, cfg.n_out)
    torch.autograd.grad(jac(x).pow(2).sum(), x)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.reps):
            torch.autograd.grad(jac(x).pow(2).sum(), x)
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=args.rows
    )
    print(f"{cfg.name} {args.method}, {args.reps} full steps\n{table}")
    return table


if __name__ == "__main__":
    main()
