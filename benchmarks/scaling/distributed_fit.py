"""laplace-torch's ``fit`` with DiffBackPackGGN: one process against 2 gloo ranks.

Every configuration runs in a fresh process (so its max RSS is its own); with
``world`` 2 the ranks are ``torch.multiprocessing.spawn`` processes of a ``gloo``
group, each fitting its own shard (rank 0 the first ``ceil(N/2)`` points, a
``Subset``), one thread each. The data: generated regression (10 inputs, float64),
an MLP 10-50-50-1 (tanh, 3151 parameters). Measured per configuration: seconds of
``Laplace(...).fit(loader)`` (the slowest rank; the ranks start their clocks after
a barrier), the fit's own peak RSS above the RSS just before it (``/proc``
high-water mark reset after imports, model and data; the largest over the ranks),
the process's max RSS, and the log marginal likelihood, whose relative difference
to the one-process fit is reported.

Usage::

    python benchmarks/scaling/distributed_fit.py          # N = 1e4, 1e5
    python benchmarks/scaling/distributed_fit.py --quick  # N = 600 (run by a test)

Writes ``distributed_fit.json`` and ``DISTRIBUTED_FIT.md`` into ``--out`` (default:
beside this script).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import time

import torch
import torch.distributed as dist
from fresh import run_fresh  # benchmarks/scaling/ is on sys.path
from memory import reset_peak, rss_kib
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from laplace_diffjac.data._ranks import run_on_ranks

HERE = pathlib.Path(__file__).resolve().parent
BATCH = 250
FLAVOURS = [("all", "kron"), ("all", "diag"), ("last_layer", "full"), ("all", "full")]


def _problem(n: int) -> tuple[nn.Module, TensorDataset]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(10, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 1)
    ).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 10, generator=gen, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.1 * torch.randn(
        n, 1, generator=gen, dtype=torch.float64
    )
    return model, TensorDataset(x, y)


def measure(rank: int, world: int, cfg: dict) -> dict:
    """Fit one flavour on this rank's shard; seconds, memory and the evidence."""
    from laplace import Laplace

    from laplace_diffjac import DiffBackPackGGN

    model, data = _problem(cfg["n"])
    first = (cfg["n"] + 1) // 2
    if world > 1:
        data = Subset(data, range(0, first) if rank == 0 else range(first, cfg["n"]))
    loader = DataLoader(data, batch_size=BATCH)
    la = Laplace(
        model, "regression", cfg["subset"], cfg["structure"], backend=DiffBackPackGGN
    )
    if world > 1:
        dist.barrier()  # start the clocks together: not the other rank's imports
    before = reset_peak()
    start = time.perf_counter()
    la.fit(loader)
    seconds = time.perf_counter() - start
    return {
        "fit_s": seconds,
        "peak_inc_mib": (rss_kib("VmHWM") - before) / 1024,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "lml": float(la.log_marginal_likelihood()),
        "n_data": la.n_data,
    }


def worker(cfg: dict) -> dict:
    """One configuration, in this fresh process or on spawned ranks."""
    if cfg["world"] == 1:
        torch.set_num_threads(1)
        return measure(0, 1, cfg)
    outs = run_on_ranks(measure, cfg["world"], cfg, start_method="spawn")
    if len({o["lml"] for o in outs}) != 1:
        raise RuntimeError(f"ranks disagree on the evidence: {outs}")
    merged = {k: max(o[k] for o in outs) for k in ("fit_s", "peak_inc_mib", "rss_mib")}
    return dict(merged, lml=outs[0]["lml"], n_data=outs[0]["n_data"])


def grid(quick: bool) -> list[dict]:
    """Configurations: every flavour, N, 1 and 2 ranks (``quick``: one, tiny)."""
    if quick:
        return [dict(subset="all", structure="kron", n=600, world=w) for w in (1, 2)]
    return [
        dict(subset=s, structure=h, n=n, world=w)
        for s, h in FLAVOURS
        for n in (10_000, 100_000)
        for w in (1, 2)
    ]


def table(rows: list[dict]) -> str:
    """Markdown table; the evidence difference is relative to the 1-rank row."""
    single = {(r["subset"], r["structure"], r["n"]): r for r in rows if r["world"] == 1}
    lines = [
        "| flavour | N | ranks | fit s | vs 1 process | peak over base MiB "
        "| max RSS MiB | n_data | rel. diff. log evidence |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = single[(r["subset"], r["structure"], r["n"])]
        diff = abs(r["lml"] - ref["lml"]) / abs(ref["lml"])
        speed = ref["fit_s"] / r["fit_s"]
        lines.append(
            f"| {r['subset']} x {r['structure']} | {r['n']} | {r['world']} "
            f"| {r['fit_s']:.2f} | {speed:.2f}x | {r['peak_inc_mib']:.1f} "
            f"| {r['rss_mib']:.0f} | {r['n_data']} | {diff:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=HERE)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    rows = []
    for cfg in grid(args.quick):
        rows.append(dict(cfg, **run_fresh(__file__, cfg, OMP_NUM_THREADS="1")))
        print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "distributed_fit.json").write_text(json.dumps(rows, indent=1))
    (args.out / "DISTRIBUTED_FIT.md").write_text(
        "# laplace-torch fit with DiffBackPackGGN: 1 process vs 2 gloo ranks\n\n"
        "Generated by `python benchmarks/scaling/distributed_fit.py`"
        + (" --quick" if args.quick else "")
        + " (MLP 10-50-50-1, float64, batch 250, one thread per rank; times and "
        "memory are the slowest/largest rank's; single runs on a 2-core CPU shared "
        "with other jobs, so times carry that noise).\n\n" + table(rows)
    )


if __name__ == "__main__":
    main()
