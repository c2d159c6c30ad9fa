"""``ntk(x, x)`` + d/dx on a CIFAR ResNet, with and without a memory budget.

The step a location optimiser waits for: the Gram of a batch of images and the
gradient of ``Σ K²`` in the images, on torchvision's ResNet with one
``BasicBlock`` per stage, no batch norm, 10 classes (``P`` = 4.9 M), random
3 × 32 × 32 images. Rows:

* ``factors``: ``DiffBackPackGGN``'s per-layer factor route (the default);
* ``jacobians``: ``ntk(..., structured=False)``, forming ``J`` (B·C·P);

each under the default budget (2 GiB on a CPU), a budget of 512 MiB, and no
budget (1 TiB: everything at once, as before the budget existed). The Jacobian
route runs at its own, smaller ``--jacobian-batch`` (8): one image's ``J`` is
196 MB and its graph and backward pass hold about four times that, so at B = 32
the unbudgeted route needs 17.6 GiB, and within 2 GiB it holds one row image at
a time and recomputes every column image's ``J`` once per row, forward and
backward (B² passes): minutes, where the factor route takes a second. Each row runs in
a fresh process; ``peak GiB`` is the resident memory above its value before the
step (``VmHWM`` after ``clear_refs``), ``s`` a single cold run after a warm-up on
two images. ``rel. diff`` compares each row's Gram and gradient with those of
the same route and batch without a budget: the budget changes memory and time
only. ``GFLOP`` counts the matmul-like kernels of one more step (forward and
backward, ``torch.utils.flop_counter``, a budget's recomputation included), and
the report gives that count over the row's time against a square float32
matmul's rate measured in the same run: how near each path runs to the device's
FLOP floor (issue #42, item 2).

On a GPU (``--device cuda``, with ``--model resnet18-cifar`` for the real-size
rows: ResNet-18 with the CIFAR stem, P = 11.2 M), ``peak GiB`` is the CUDA
allocator's peak above its value before the step, and the default budget is a
quarter of the free memory; ``benchmarks/gpu/run_on_gpu.py`` runs those rows.

Run: ``python benchmarks/jacobians/ntk_budget.py [--batch 32 64]
[--jacobian-batch 8] [--threads 2] [--device cuda] [--model resnet18-cifar]
[--out FILE.json] [--markdown FILE.md]``; ``--quick`` is the tests' smoke size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from fresh_process import run_worker  # noqa: E402
from measure import counted_flops, matmul_gflop_per_s, matmul_size  # noqa: E402

ROUTES = ["factors", "jacobians"]
#: The budgets of the rows: the CPU default, a small one, none (1 TiB).
BUDGETS = ["default", "512 MiB", "none"]
#: ``--quick``: per route, a small budget that still chunks the smoke-size Gram.
QUICK_BUDGET = {"factors": "320 KiB", "jacobians": "960 KiB"}


def build(quick: bool, model: str = "resnet"):
    """The model of the rows, seeded, in eval mode.

    ``resnet``: one ``BasicBlock`` per stage, no batch norm (the CPU rows);
    ``resnet18-cifar``: torchvision's ResNet-18 with the CIFAR stem (a 3×3 first
    convolution, no max pooling; P = 11.2 M), the GPU rows; ``quick``: a two-layer
    CNN.
    """
    import torch
    from torch import nn
    from torchvision.models import resnet18
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    if model == "resnet18-cifar" and not quick:
        net = resnet18(num_classes=10)
        net.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
        return net.eval()
    if quick:
        net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 10),
        )
        return net.eval()
    return ResNet(
        BasicBlock, [1, 1, 1, 1], num_classes=10, norm_layer=nn.Identity
    ).eval()


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def synchronize(device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA), before reading a clock."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_from_here(device):
    """A function giving the peak memory added since this call, in GiB: the CUDA
    allocator's on a GPU, the resident high-water mark on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)

        def peak() -> float:
            torch.cuda.synchronize(device)
            return max(torch.cuda.max_memory_allocated(device) - start, 0) / 2**30

        return peak
    Path("/proc/self/clear_refs").write_text("5")
    base = rss_kib("VmRSS")
    return lambda: max(rss_kib("VmHWM") - base, 0) / 2**20


def measure(cfg: dict) -> dict:
    """One row in this process: seconds, added peak, the Gram and gradient."""
    import torch

    from laplace_diffjac import DiffBackPackGGN, ntk
    from laplace_diffjac.budget import memory_budget

    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg.get("device", "cpu"))
    model = build(cfg["quick"], cfg.get("model", "resnet")).to(device)
    gen = torch.Generator().manual_seed(1)
    size = 8 if cfg["quick"] else 32
    x = torch.randn(cfg["batch"], 3, size, size, generator=gen).to(device)
    backend = DiffBackPackGGN(model, "classification")
    structured = None if cfg["route"] == "factors" else False
    budget = {"default": None, "none": "1 TiB"}.get(cfg["budget"], cfg["budget"])

    def step(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.clone().requires_grad_()
        with memory_budget(budget):
            K = ntk(backend, inputs, structured=structured)
        (g,) = torch.autograd.grad((K**2).sum(), inputs)
        return K.detach(), g

    row = {k: cfg[k] for k in ("route", "budget", "batch")}
    row["n_params"] = sum(p.numel() for p in model.parameters())
    try:
        step(x[:2])
        peak = peak_from_here(device)
        start = time.perf_counter()
        K, g = step(x)
        synchronize(device)
        row["seconds"] = time.perf_counter() - start
        row["peak_gib"] = peak()
        torch.save({"K": K.cpu(), "g": g.cpu()}, cfg["result"])
        del K, g
        row["gflop"] = counted_flops(lambda: step(x)) / 1e9
    except Exception as exc:  # noqa: BLE001 (a failure is a result)
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"[:300]
    return row


def _fresh(cfg: dict, timeout: float) -> dict:
    keys = ("route", "budget", "batch")
    return run_worker(Path(__file__).resolve(), cfg, timeout, keys)


def _compare(rows: list[dict], results: dict) -> None:
    """Each row against the same route and batch without a budget: its time as a
    ratio, and the largest relative difference of its Gram and gradient."""
    import torch

    for row in rows:
        here = (row["route"], row["budget"], row["batch"])
        key = (row["route"], "none", row["batch"])
        if here not in results or key not in results:
            continue
        ref, got = torch.load(results[key]), torch.load(results[here])
        row["rel_diff"] = max(
            float((got[k] - ref[k]).abs().max() / ref[k].abs().max())
            for k in ("K", "g")
        )
        base = next(r for r in rows if (r["route"], r["budget"], r["batch"]) == key)
        row["time_ratio"] = row["seconds"] / base["seconds"]


def report(results: dict) -> str:
    """The Markdown table of a run."""
    meta = results["meta"]
    device, model = meta.get("device", "cpu"), meta.get("model", "resnet")
    described = {
        "resnet": "torchvision's ResNet (one BasicBlock per stage, no batch norm",
        "resnet18-cifar": "ResNet-18 with the CIFAR stem (batch norm in eval mode",
    }[model]
    peak = "the CUDA allocator's peak" if device != "cpu" else "resident memory"
    lines = [
        "# `ntk(x, x)` + d/dx on a CIFAR ResNet within the memory budget",
        "",
        f"Generated by `python benchmarks/jacobians/ntk_budget.py --device {device} "
        f"--model {model} --threads {meta['threads']}`: {described}, 10 classes, "
        f"P = {meta['n_params']:,}), random 3 × 32 × 32 images, "
        f"{meta['threads']} thread(s), torch {meta['torch']}, "
        f"{meta['machine']}, {meta['date']}. Each row a fresh process, one cold run "
        f"after a warm-up on two images; peak: {peak} above its value "
        "before the step. `× none` is the time against the same route and batch "
        "without a budget; `rel. diff` the largest relative difference of the Gram "
        "and its gradient to that row's. GFLOP: the matmul-like kernels of one more "
        "step (forward and backward), counted by `torch.utils.flop_counter` (two per "
        "multiply-add; elementwise work, copies and reductions count zero), "
        "recomputation under a budget included; GFLOP/s: that count over the row's "
        "time; % of matmul: that rate over a square float32 matmul's on the same "
        f"device and threads ({meta['matmul_gflop_per_s']:.0f} GFLOP/s), the "
        "practical ceiling of contraction-bound work.",
        "",
        "| B | route | budget | s | peak GiB | × none | GFLOP | GFLOP/s | "
        "% of matmul | rel. diff |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['batch']} | {r['route']} | {r['budget']} | – | – | – | – | – "
                f"| – | {r['error']} |"
            )
            continue
        ratio = f"{r['time_ratio']:.2f}" if "time_ratio" in r else "–"
        diff = f"{r['rel_diff']:.1e}" if "rel_diff" in r else "–"
        rate = r["gflop"] / r["seconds"]
        share = 100 * rate / meta["matmul_gflop_per_s"]
        lines.append(
            f"| {r['batch']} | {r['route']} | {r['budget']} | {r['seconds']:.2f} | "
            f"{r['peak_gib']:.2f} | {ratio} | {r['gflop']:.3g} | {rate:.3g} | "
            f"{share:.1f} | {diff} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    """Run every row in its own process; write the JSON and the Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--jacobian-batch", type=int, nargs="*", default=[8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--model", default="resnet", choices=["resnet", "resnet18-cifar"]
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=HERE / "ntk_budget.json")
    parser.add_argument("--markdown", type=Path, default=HERE / "NTK_BUDGET.md")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return {}
    import tempfile

    import torch

    rows, files = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(b, "factors") for b in args.batch]
        runs += [(b, "jacobians") for b in args.jacobian_batch]
        for batch, route in runs:
            for budget in BUDGETS:
                if args.quick and budget == "512 MiB":
                    budget = QUICK_BUDGET[route]
                result = str(Path(tmp) / f"{route}-{budget}-{batch}.pt")
                cfg = dict(route=route, budget=budget, batch=batch, quick=args.quick)
                cfg.update(threads=args.threads, result=result)
                cfg.update(device=args.device, model=args.model)
                row = _fresh(cfg, args.timeout)
                print(json.dumps(row), flush=True)
                rows.append(row)
                if "seconds" in row:
                    files[(route, budget, batch)] = result
        _compare(rows, files)
    torch.set_num_threads(args.threads)
    where = torch.device(args.device)
    meta = {
        "matmul_gflop_per_s": matmul_gflop_per_s(where, matmul_size(where, args.quick)),
        "device": args.device,
        "model": args.model,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "date": datetime.date.today().isoformat(),
        "n_params": next((r["n_params"] for r in rows if "n_params" in r), 0),
        "quick": args.quick,
    }
    results = {"meta": meta, "rows": rows}
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    args.markdown.write_text(report(results))
    return results


if __name__ == "__main__":
    main()
