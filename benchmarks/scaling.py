"""Scaling of the streamed location optimiser and ContextPosterior.fit with N.

Every measurement runs in a fresh process (so its max RSS is its own): a
generated regression problem streamed from an ``IterableDataset`` (inputs drawn
batch by batch from seeded generators, never materialised), an MLP (10-50-50-1,
tanh) or a small CNN (1x8x8 input, Conv2d(1, 4, 3), tanh, Flatten, Linear).
With ``--world K > 1`` the measurement runs on K ``gloo`` processes
(``torch.multiprocessing.spawn``), each streaming its own shard (every K-th
batch). Reported per run: seconds per optimiser step, seconds of the
optimiser's one pass over the data (N, lr, initial locations), seconds of
``ContextPosterior.fit`` and the largest max RSS over the ranks.

Usage::

    python benchmarks/scaling.py            # full grid, writes SCALING.md/.png
    python benchmarks/scaling.py --quick    # tiny grid (exercised by a test)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

HERE = pathlib.Path(__file__).resolve().parent
BATCH = 256


class Generated(IterableDataset):
    """``n`` inputs ``(n, *shape)`` with targets, generated batch by batch.

    Batch ``i`` comes from ``torch.Generator().manual_seed(seed + i)``; rank
    ``r`` of ``world`` yields the batches ``i ≡ r (mod world)``.
    """

    def __init__(self, n: int, shape: tuple, rank: int = 0, world: int = 1) -> None:
        self.n, self.shape, self.rank, self.world = n, shape, rank, world

    def __iter__(self):
        for i, start in enumerate(range(0, self.n, BATCH)):
            if i % self.world != self.rank:
                continue
            gen = torch.Generator().manual_seed(1000 + i)
            b = min(BATCH, self.n - start)
            x = torch.randn((b, *self.shape), generator=gen)
            y = torch.sin(x.reshape(b, -1).sum(1, keepdim=True))
            yield x, y


def make_model(kind: str) -> tuple[nn.Module, tuple]:
    """The network and its input shape."""
    torch.manual_seed(0)
    if kind == "mlp":
        net = nn.Sequential(
            nn.Linear(10, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 1)
        )
        return net, (10,)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(144, 1))
    return net, (1, 8, 8)


def measure(rank: int, world: int, cfg: dict) -> dict:
    """One measurement on this rank (the optimiser, then optionally fit)."""
    from laplace_diffjac.context import (
        ContextPosterior,
        LocationSettings,
        optimize_locations,
    )

    model, shape = make_model(cfg["model"])
    loader = DataLoader(Generated(cfg["n"], shape, rank, world), batch_size=None)
    settings = LocationSettings(
        steps=cfg["steps"], lr=0.01, patience=0, progress_bar=False, max_inputs=1000
    )
    start = time.perf_counter()
    result = optimize_locations(
        model, "regression", loader, cfg["m"], init="random", settings=settings
    )
    total = time.perf_counter() - start
    times = result.history.time
    per_step = (times[-1] - times[0]) / (len(times) - 1)
    out = {"step_s": per_step, "pass_s": total - times[-1], "fit_s": float("nan")}
    if cfg["fit"]:
        start = time.perf_counter()
        ContextPosterior(model, "regression", result.locations).fit(loader)
        out["fit_s"] = time.perf_counter() - start
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _rank_main(rank: int, world: int, folder: str, cfg: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world
    )
    try:
        out = measure(rank, world, cfg)
        (pathlib.Path(folder) / f"{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def worker(cfg: dict) -> dict:
    """Run one configuration (in this fresh process, or on spawned ranks)."""
    if cfg["world"] == 1:
        torch.set_num_threads(1)
        return measure(0, 1, cfg)
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank_main, args=(cfg["world"], folder, cfg), nprocs=cfg["world"])
        outs = [
            json.loads((pathlib.Path(folder) / f"{r}.json").read_text())
            for r in range(cfg["world"])
        ]
    merged = {k: max(o[k] for o in outs) for k in ("step_s", "pass_s", "fit_s")}
    merged["rss_mib"] = max(o["rss_mib"] for o in outs)
    return merged


def run_fresh(cfg: dict) -> dict:
    """Measure ``cfg`` in a fresh Python process."""
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def grid(name: str) -> list[dict]:
    """The configurations measured (see SCALING.md for what was run)."""
    if name == "small":  # what fits a loaded 2-core machine in ~10 minutes
        mlp = dict(model="mlp", m=64, steps=10)
        return [
            dict(mlp, n=10_000, world=1, fit=True),
            dict(mlp, n=100_000, world=1, fit=False),
            dict(mlp, n=1_000_000, world=1, fit=False),
            dict(mlp, n=10_000, world=1, fit=False, m=256),
            dict(mlp, n=10_000, world=1, fit=False, model="cnn"),
            dict(mlp, n=10_000, world=2, fit=True),
        ]
    if name == "more":  # the distributed rows added after "small"
        mlp = dict(model="mlp", m=64, steps=10, fit=False)
        return [dict(mlp, n=100_000, world=2), dict(mlp, n=10_000, world=4)]
    if name == "quick":
        base = dict(steps=3, fit=True)
        return [
            dict(base, model="mlp", n=600, m=8, world=1),
            dict(base, model="cnn", n=600, m=8, world=2),
        ]
    cfgs = []
    for model in ("mlp", "cnn"):
        for m in (64, 256):
            for n in (10_000, 100_000, 1_000_000):
                fit = n <= 100_000 and m == 64
                cfgs.append(dict(model=model, n=n, m=m, world=1, steps=10, fit=fit))
    for world in (2, 4):
        for n in (10_000, 100_000):
            cfgs.append(dict(model="mlp", n=n, m=64, world=world, steps=10, fit=True))
    return cfgs


def report(rows: list[dict], folder: pathlib.Path) -> None:
    """Write SCALING.md (table) and scaling.png (log-log against N)."""
    lines = [
        "# Scaling with N (streamed IterableDataset, batch 256)",
        "",
        "2-core CPU shared with other jobs, no GPU was available; each row is a",
        "fresh process (K gloo ranks for world K, 1 thread each). Written by",
        "`python benchmarks/scaling.py`.",
        "",
        "| model | M | N | world | s/step | pass s | fit s | max RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['m']} | {r['n']:,} | {r['world']} | "
            f"{r['step_s']:.4f} | {r['pass_s']:.2f} | {r['fit_s']:.2f} | "
            f"{r['rss_mib']:.0f} |"
        )
    (folder / "SCALING.md").write_text("\n".join(lines) + "\n")
    _plot(rows, folder / "scaling.png")


def _plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    keys = sorted({(r["model"], r["m"], r["world"]) for r in rows})
    for key in keys:
        sel = sorted(
            (r for r in rows if (r["model"], r["m"], r["world"]) == key),
            key=lambda r: r["n"],
        )
        n = [r["n"] for r in sel]
        label = f"{key[0]} M={key[1]} K={key[2]}"
        for ax, field in zip(axes, ("step_s", "fit_s", "rss_mib")):
            ys = [r[field] for r in sel]
            if any(y == y for y in ys):
                ax.loglog(n, ys, "o-", label=label)
    for ax, title in zip(axes, ("s per optimiser step", "fit s", "max RSS MiB")):
        ax.set_xlabel("N")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--grid", choices=("quick", "small", "more", "full"), default="full"
    )
    parser.add_argument("--out", type=pathlib.Path, default=HERE)
    parser.add_argument("--worker", type=str, default=None)
    parser.add_argument("--append", action="store_true", help="keep scaling.json rows")
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "scaling.json"
    rows = json.loads(saved.read_text()) if args.append and saved.exists() else []
    for cfg in grid("quick" if args.quick else args.grid):
        start = time.perf_counter()
        rows.append(dict(cfg, **run_fresh(cfg)))
        print(json.dumps(rows[-1]), f"{time.perf_counter() - start:.0f}s", flush=True)
        saved.write_text(json.dumps(rows, indent=1))
        report(rows, args.out)  # after every row: a cut-short run keeps its rows


if __name__ == "__main__":
    main()
