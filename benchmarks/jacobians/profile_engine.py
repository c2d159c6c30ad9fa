"""Where the time of one Jacobian route goes: ``python profile_engine.py [options]``.

Prints torch.profiler's operator table of the full step (Jacobians + gradient of
``‖J‖²`` w.r.t. x, or w.r.t. the parameters for token inputs), e.g.
``--config mlp,512,10,32 --method DiffBackPackGGN`` or, by name from
``cases.FULL``, ``--config transformer-v100-d32-T32-C10-B64``. ``--jac-only`` profiles
the Jacobians alone; ``--shapes`` groups the operators by input shape;
``--device cuda`` runs on the GPU and adds its kernels to the profile.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from cases import FULL, Config, to_device  # noqa: E402
from methods import JACOBIAN_METHODS  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def _config(spec: str) -> Config:
    """A configuration of ``cases.FULL`` by name, or ``kind,width,C,B``."""
    by_name = {c.name: c for c in FULL}
    if spec in by_name:
        return by_name[spec]
    kind, width, n_out, batch = spec.split(",")
    return Config(kind, int(width), int(n_out), int(batch))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="mlp,512,10,32", help="name or k,w,C,B")
    parser.add_argument("--method", default="DiffBackPackGGN")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--jac-only", action="store_true", help="no gradient step")
    parser.add_argument("--shapes", action="store_true", help="group by shapes")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    args = parser.parse_args(argv)
    cfg = _config(args.config)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    model, x = cfg.model().to(device), to_device(cfg.inputs(), device)
    if isinstance(x, dict):  # token ids: differentiate in the parameters
        leaves = list(model.parameters())
    else:
        leaves = [x.requires_grad_(True)]
    jac = JACOBIAN_METHODS[args.method](model, cfg.n_out)

    def step() -> object:
        J = jac(x)
        if args.jac_only:
            return J
        return torch.autograd.grad(J.pow(2).sum(), leaves, allow_unused=True)

    step()  # warm-up
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=args.shapes) as prof:
        for _ in range(args.reps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    table = prof.key_averages(group_by_input_shape=args.shapes).table(
        sort_by="self_cpu_time_total", row_limit=args.rows
    )
    what = "Jacobians" if args.jac_only else "full steps"
    print(f"{cfg.name} {args.method}, {args.reps} {what}\n{table}")
    return table


if __name__ == "__main__":
    main()
