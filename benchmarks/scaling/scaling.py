"""Scaling of the streamed location optimiser and ContextPosterior.fit with N.

Every measurement runs in a fresh process (so its max RSS is its own): a
generated regression problem streamed from an ``IterableDataset`` (inputs drawn
batch by batch from seeded generators, never materialised), an MLP (10-50-50-1,
tanh) or a small CNN (1x8x8 input, Conv2d(1, 4, 3), tanh, Flatten, Linear).
A configuration with ``world`` K > 1 runs on K ``gloo`` processes
(``torch.multiprocessing.spawn``), each streaming its own shard (every K-th
batch). Each process does one job: the optimiser (seconds per step and of its
one pass over the data for N, lr and the initial locations) or
``ContextPosterior.fit`` (seconds); memory is the work's peak RSS above the
RSS just before it, and the process's max RSS (largest over the ranks).

Usage::

    python benchmarks/scaling/scaling.py            # full grid, SCALING.md/.png here
    python benchmarks/scaling/scaling.py --quick    # tiny grid (exercised by a test)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import time

import torch
from fresh import run_fresh  # benchmarks/scaling/ is on sys.path
from memory import reset_peak, rss_kib
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from laplace_diffjac.data._ranks import run_on_ranks

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
    """One measurement on this rank: the optimiser or ``ContextPosterior.fit``.

    Returns seconds per optimiser step (the median over the steps) and of its
    one data pass (optimiser), or of ``fit``; ``rss_mib`` is the process's max
    RSS, ``peak_inc_mib`` the work's peak RSS above the RSS just before it
    (imports, model, loader).
    """
    from laplace_diffjac.context import (
        ContextPosterior,
        LocationSettings,
        optimize_locations,
    )

    model, shape = make_model(cfg["model"])
    loader = DataLoader(Generated(cfg["n"], shape, rank, world), batch_size=None)
    out = {"step_s": float("nan"), "pass_s": float("nan"), "fit_s": float("nan")}
    before = reset_peak()
    start = time.perf_counter()
    if cfg["job"] == "optimize":
        settings = LocationSettings(
            steps=cfg["steps"], lr=0.01, patience=0, progress_bar=False, max_inputs=1000
        )
        result = optimize_locations(
            model, "regression", loader, cfg["m"], init="random", settings=settings
        )
        total = time.perf_counter() - start
        times = result.history.time
        steps = torch.tensor(times).diff()  # a loaded machine: the median step
        out["step_s"] = float(steps.median())
        out["pass_s"] = total - times[-1]
    else:
        gen = torch.Generator().manual_seed(0)
        locations = torch.randn((cfg["m"], *shape), generator=gen)
        ContextPosterior(model, "regression", locations).fit(loader)
        out["fit_s"] = time.perf_counter() - start
    out["peak_inc_mib"] = (rss_kib("VmHWM") - before) / 1024
    out["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def worker(cfg: dict) -> dict:
    """Run one configuration (in this fresh process, or on spawned ranks)."""
    if cfg["world"] == 1:
        torch.set_num_threads(1)
        return measure(0, 1, cfg)
    outs = run_on_ranks(measure, cfg["world"], cfg, start_method="spawn")
    keys = ("step_s", "pass_s", "fit_s", "rss_mib", "peak_inc_mib")
    return {k: max(o[k] for o in outs) for k in keys}


def _fresh(cfg: dict) -> dict:
    """Measure ``cfg`` in a fresh Python process."""
    env = {}
    if cfg.get("mmap_threshold"):  # glibc: fixed instead of adaptive threshold
        env["MALLOC_MMAP_THRESHOLD_"] = str(cfg["mmap_threshold"])
    return run_fresh(__file__, cfg, **env)


SIZES = (10_000, 100_000, 1_000_000)


def grid(name: str) -> list[dict]:
    """The configurations measured (see SCALING.md for what was run).

    ``job`` is ``"optimize"`` (10 optimiser steps after its one data pass) or
    ``"fit"`` (``ContextPosterior.fit`` on random locations); each runs in its
    own process so that each has its own peak memory. ``"steps"`` re-times the
    one-process optimiser rows; ``"allocator"`` repeats the MLP's ``fit`` with
    glibc's mmap threshold fixed (N = 10⁴, 10⁵: a fixed threshold is slow).
    """
    if name == "quick":
        return [
            dict(model="mlp", n=600, m=8, world=1, steps=3, job="optimize"),
            dict(model="cnn", n=600, m=8, world=2, steps=3, job="fit"),
        ]
    if name == "steps":
        return [c for c in _full_grid() if c["job"] == "optimize" and c["world"] == 1]
    if name == "allocator":
        fit = dict(model="mlp", m=64, world=1, steps=10, job="fit")
        return [dict(fit, n=n, mmap_threshold=65536) for n in SIZES[:2]]
    return _full_grid()


def _full_grid() -> list[dict]:
    cfgs = []
    for job in ("optimize", "fit"):
        for model in ("mlp", "cnn"):
            for m in (64, 256):
                for n in SIZES:
                    cfgs.append(dict(model=model, n=n, m=m, world=1, steps=10, job=job))
    for world in (2, 4):
        for job in ("optimize", "fit"):
            for n in SIZES:
                mlp = dict(model="mlp", m=64, steps=10, job=job)
                cfgs.append(dict(mlp, n=n, world=world))
    return cfgs


def _cell(value: float, digits: int) -> str:
    """``value`` with ``digits`` significant digits, fixed-point when ≥ 10^digits.

    Fixed decimals printed a fast data pass as ``0.00`` on a quick machine.
    """
    if value != value:
        return "–"
    return f"{value:.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"


def report(rows: list[dict], folder: pathlib.Path) -> None:
    """Write SCALING.md (table) and scaling.png (log-log against N)."""
    lines = [
        "# Scaling with N (streamed IterableDataset, batch 256)",
        "",
        "Written by `python benchmarks/scaling/scaling.py`. Each row is a fresh",
        "process (K gloo ranks for K ranks, one thread each). `peak over base`:",
        "the work's peak RSS above the RSS just before it (after imports, model",
        "and loader; the largest over the ranks); `max RSS`: the process's whole",
        "peak, imports included. `malloc`: glibc's default (adaptive mmap",
        "threshold) or `MALLOC_MMAP_THRESHOLD_` fixed, which keeps freed large",
        "blocks from fragmenting the heap.",
        "",
        "| job | model | M | N | ranks | s / step | data pass s | fit s "
        "| peak over base MiB | max RSS MiB | malloc |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = ("optimize", "fit")
    for r in sorted(rows, key=lambda r: (order.index(r["job"]), *_key(r), r["n"])):
        lines.append(
            f"| {r['job']} | {r['model']} | {r['m']} | {r['n']:,} | {r['world']} | "
            f"{_cell(r['step_s'], 4)} | {_cell(r['pass_s'], 3)} | "
            f"{_cell(r['fit_s'], 3)} | {_cell(r['peak_inc_mib'], 3)} | "
            f"{r['rss_mib']:.0f} | {_malloc(r)} |"
        )
    (folder / "SCALING.md").write_text("\n".join(lines) + "\n")
    _plot(rows, folder / "scaling.png")


def _plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("optimize", "step_s"), ("fit", "fit_s"))
    keys = sorted({(r["job"], *_key(r)) for r in rows})
    for key in keys:
        sel = sorted((r for r in rows if (r["job"], *_key(r)) == key), key=_n)
        n = [r["n"] for r in sel]
        label = f"{key[1]} M={key[2]} K={key[3]}" + (" fixed mmap" if key[4] else "")
        for ax, (job, field) in zip(axes, panels):
            if key[0] == job:
                ax.loglog(n, [r[field] for r in sel], "o-", label=label)
        style = "o-" if key[0] == "optimize" else "s--"
        inc = [max(r["peak_inc_mib"], 0.1) for r in sel]
        axes[2].loglog(n, inc, style, label=f"{key[0]} {label}")
    titles = ("s per optimiser step", "ContextPosterior.fit s", "peak over base MiB")
    for ax, title in zip(axes, titles):
        ax.set_xlabel("N")
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _malloc(row: dict) -> str:
    threshold = row.get("mmap_threshold")
    return f"mmap ≥ {threshold // 1024} KiB" if threshold else "default"


def _key(row: dict) -> tuple:
    return row["model"], row["m"], row["world"], row.get("mmap_threshold", 0)


def _n(row: dict) -> int:
    return row["n"]


def main() -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--grid", choices=("quick", "full", "steps", "allocator"), default="full"
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
        rows.append(dict(cfg, **_fresh(cfg)))
        print(json.dumps(rows[-1]), f"{time.perf_counter() - start:.0f}s", flush=True)
        saved.write_text(json.dumps(rows, indent=1))
        report(rows, args.out)  # after every row: a cut-short run keeps its rows


if __name__ == "__main__":
    main()
