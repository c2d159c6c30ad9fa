"""``ContextPosterior`` on a CIFAR ResNet within the memory budget, against its floor.

Rows: ``fit`` over ``N`` random 3 × 32 × 32 images (batches of 256, classification,
float64 sums), one prediction at 64 test inputs and the evidence, for ``M``
locations and three budgets (``none``: 1 TiB; ``default``: 2 GiB on a CPU;
``512 MiB``), each in a fresh process with two threads; its added peak is the
resident high-water mark above its value before ``fit``. Each row's predictive
variance and evidence are compared with the same ``M``'s float64 row under the
first budget listed (``none`` by default).
``--dtypes float64 float32`` adds rows whose posterior computes in float32
(``compute_dtype``): their differences are float32's error (issue #42, item 4),
their floor is measured in float32.

The floor (issue #42): one Jacobian pass over the data (``DiffBackPackGGN.jacobians``
on 16 images, in chunks of 8, scaled to ``N``) plus ``P M C²`` multiply-adds per
data point for ``K(Z, X)``, at the float64 matmul rate measured in the same
process (a 2048² product). ``fit / floor`` below 1 means the per-layer factors
beat the contraction the floor counts.

Each row also counts the matmul-like FLOPs of one more, untimed run of the
same call (``torch.utils.flop_counter``): the report gives them over the timed
run's seconds against the matmul rate, how near each path runs to its floor.

``optimize_locations`` is measured the same way (``--paths step``): three steps of
the Nyström gap with ``M`` = 32 locations from the first images and minibatches of
128 out of 256 images, seconds a step against one minibatch's Jacobian pass.

On a GPU (``--device cuda --model resnet18-cifar``, as ``benchmarks/gpu/run_on_gpu.py``
runs it): torchvision's ResNet-18 with the CIFAR stem, peak memory from the CUDA
allocator (above its value before the call), times after synchronising, the floor's
matmul rate from a 4096² product.

Run: ``python benchmarks/context_posterior/context_budget.py [--quick]
[--locations 16 64] [--n-data 512] [--paths fit step] [--device cuda]
[--model resnet18-cifar] [--out JSON --markdown MD]``; results go to
``context_budget.json`` and ``CONTEXT_BUDGET.md`` beside this script unless
``--out`` is given (``--quick``: only where ``--out`` says).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BUDGETS = ("none", "default", "512 MiB")

# The CIFAR ResNet of the NTK's budget rows (its CPU model) and the memory probe.
sys.path.insert(0, str(ROOT / "benchmarks" / "jacobians"))
from fresh_process import run_worker  # noqa: E402
from measure import counted_flops  # noqa: E402
from ntk_budget import build, peak_from_here, synchronize  # noqa: E402


def _data(cfg: dict):
    import torch

    gen = torch.Generator().manual_seed(1)
    size = 8 if cfg["quick"] else 32
    x = torch.randn(cfg["n_data"], 3, size, size, generator=gen)
    y = torch.randint(0, 10, (cfg["n_data"],), generator=gen)
    xs = torch.randn(64, 3, size, size, generator=gen)
    device = cfg.get("device", "cpu")
    x, y, xs = x.to(device), y.to(device), xs.to(device)
    return x, y, x[: cfg["locations"]].clone(), xs


def _model(cfg: dict):
    """The row's model on the row's device."""
    return build(cfg["quick"], cfg.get("model", "resnet")).to(cfg.get("device", "cpu"))


def _set_up(cfg: dict, keys: tuple[str, ...]):
    """A row's model, its device, the data, the budget as ``memory_budget`` takes
    it, and the row with the settings ``keys``."""
    import torch

    torch.set_num_threads(cfg["threads"])
    model = _model(cfg)
    budget = {"default": None, "none": "1 TiB"}.get(cfg["budget"], cfg["budget"])
    row = {k: cfg[k] for k in keys}
    return model, next(model.parameters()).device, _data(cfg), budget, row


def measure_row(cfg: dict) -> dict:
    """One posterior row in this process."""
    import torch

    from laplace_diffjac import ContextPosterior
    from laplace_diffjac.budget import memory_budget

    keys = ("path", "locations", "budget", "n_data", "dtype")
    model, device, (x, y, z, xs), budget, row = _set_up(cfg, keys)
    dtype = getattr(torch, cfg["dtype"])
    try:
        with memory_budget(budget):
            cp = ContextPosterior(model, "classification", z, compute_dtype=dtype)
            peak = peak_from_here(device)
            start = time.perf_counter()
            cp.fit((x, y))
            synchronize(device)
            row["fit_s"] = time.perf_counter() - start
            start = time.perf_counter()
            _, var = cp._glm_predictive_distribution(xs)
            synchronize(device)
            row["predict_s"] = time.perf_counter() - start
            evidence = cp.log_marginal_likelihood()
            row["peak_gib"] = peak()
            # one more fit under the counter, untimed: the FLOPs of the timed one
            refit = ContextPosterior(model, "classification", z, compute_dtype=dtype)
            row["fit_gflop"] = counted_flops(lambda: refit.fit((x, y))) / 1e9
        chunks = cp._chunks
        assert chunks is not None
        row["plan"] = (
            "whole"
            if chunks.whole
            else f"chunks of {chunks.data}, locations in blocks of {chunks.locations}"
            f" ({'held' if chunks.hold_locations else 'recomputed'})"
        )
        result = {"var": var.cpu(), "evidence": evidence.detach().cpu()}
        torch.save(result, cfg["result"])
    except Exception as exc:  # noqa: BLE001 (a failure is a result)
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"[:300]
    return row


def measure_step(cfg: dict) -> dict:
    """One ``optimize_locations`` row in this process: seconds a step, peak."""
    import torch

    from laplace_diffjac.budget import memory_budget
    from laplace_diffjac.context import optimize_locations

    keys = ("path", "locations", "budget", "n_data", "minibatch")
    model, device, (x, _, z, _), budget, row = _set_up(cfg, keys)
    try:
        with memory_budget(budget):
            peak = peak_from_here(device)
            start = time.perf_counter()
            result = optimize_locations(
                model, "classification", x, cfg["locations"], init=z,
                steps=3, batch_size=cfg["minibatch"], patience=0, progress_bar=False,
            )  # fmt: skip
            synchronize(device)
            row["total_s"] = time.perf_counter() - start
            row["peak_gib"] = peak()
            row["plan"] = _step_plan(model, z, cfg["minibatch"], cfg["n_data"])
            # the same call once more under the counter, untimed
            row["total_gflop"] = (
                counted_flops(
                    lambda: optimize_locations(
                        model,
                        "classification",
                        x,
                        cfg["locations"],
                        init=z,
                        steps=3,
                        batch_size=cfg["minibatch"],
                        patience=0,
                        progress_bar=False,
                    )  # fmt: skip
                )
                / 1e9
            )
        times = result.history.time
        row["step_s"] = (times[-1] - times[0]) / (len(times) - 1)
        objective = torch.tensor(result.history.objective, dtype=torch.float64)
        locations = result.locations.detach().cpu()
        torch.save({"locations": locations, "objective": objective}, cfg["result"])
    except Exception as exc:  # noqa: BLE001 (a failure is a result)
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"[:300]
    return row


def _step_plan(model, z, minibatch: int, n_data: int) -> str:
    """The plan the optimiser's step takes under the budget in force, in words."""

    from laplace_diffjac import DiffBackPackGGN
    from laplace_diffjac.budget import get_memory_budget
    from laplace_diffjac.context.locations._budgeted_step import (
        feature_chunk,
        plan_step,
        route_sizes,
    )
    from laplace_diffjac.context.locations._routes import make_route

    device = next(model.parameters()).device
    backend = DiffBackPackGGN(model, "classification")
    route = make_route(backend, 1.0, None, device)
    sizes = route_sizes(route, z)
    budget = get_memory_budget(device)
    cached = n_data * sizes.features  # the training cache keeps them if ≤ 1/4
    left = budget - (cached if cached <= budget / 4 else 0)
    plan = plan_step(sizes, len(z), minibatch, feature_chunk(sizes, 256, budget), left)
    if plan.whole:
        return "whole"
    how = "held" if plan.hold else "recomputed"
    columns = "" if plan.width is None else f", columns of {plan.width}"
    batch = "" if plan.hold_batch else ", minibatch recomputed per use"
    return f"locations in blocks of {plan.block} ({how}){columns}{batch}"


def measure_floor(cfg: dict) -> dict:
    """The floor's pieces in this process: matmul rate, one Jacobian pass."""
    import torch

    from laplace_diffjac import DiffBackPackGGN

    torch.set_num_threads(cfg["threads"])
    dtype = getattr(torch, cfg["dtype"])
    device = torch.device(cfg.get("device", "cpu"))
    size, repeats = (4096, 10) if device.type == "cuda" else (2048, 3)
    a = torch.randn(size, size, dtype=dtype, device=device)
    a @ a
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    synchronize(device)
    rate = repeats * 2 * size**3 / (time.perf_counter() - start)
    model = _model(cfg).to(dtype)
    backend = DiffBackPackGGN(model, "classification")
    x, _, _, _ = _data(dict(cfg, n_data=16, locations=1))
    x = x.to(dtype)
    backend.jacobians(x[:2], enable_backprop=False)
    synchronize(device)
    start = time.perf_counter()
    for chunk in x.split(8):
        backend.jacobians(chunk, enable_backprop=False)
    synchronize(device)
    per_input = (time.perf_counter() - start) / len(x)
    n_params = sum(p.numel() for p in model.parameters())
    return {"flops_per_s": rate, "jacobian_s_per_input": per_input, "P": n_params}


def _fresh(cfg: dict, timeout: float) -> dict:
    return run_worker(Path(__file__).resolve(), cfg, timeout)


def _floor_s(floor: dict, row: dict, n_outputs: int = 10) -> float:
    """Seconds of one Jacobian pass over the data plus ``N P M C²`` at the rate."""
    n, m = row["n_data"], row["locations"]
    contraction = 2 * n * floor["P"] * m * n_outputs**2 / floor["flops_per_s"]
    return n * floor["jacobian_s_per_input"] + contraction


def _compare(rows: list[dict], results: dict, reference: str = "none") -> None:
    """Each row's largest relative differences to its path's and ``M``'s float64
    row under the ``reference`` budget: per result (``rel_diffs``) and the largest
    (``rel_diff``)."""
    for row in rows:
        key = (row["path"], row["locations"])
        ref = results.get((*key, reference, "float64"))
        got = results.get((*key, row["budget"], row.get("dtype", "float64")))
        if ref is None or got is None:
            continue
        diffs = {
            k: float(
                (got[k].double() - ref[k].double()).abs().max()
                / ref[k].double().abs().max().clamp_min(1e-300)
            )
            for k in ref
        }
        row["rel_diffs"] = diffs
        row["rel_diff"] = max(diffs.values())


def _floors_in_words(rows: list[dict], default: dict) -> str:
    """The distinct floors of ``rows``, per path, in words."""
    seen: dict[str, dict] = {}
    for row in rows:
        dtype = row.get("dtype", "float64")
        seen.setdefault(f"{row['path']} rows ({dtype})", row.get("floor", default))
    return "; ".join(
        f"{group}: {f['jacobian_s_per_input']:.3f} s an image, "
        f"{f['flops_per_s'] / 1e9:.1f} GFLOP/s"
        for group, f in seen.items()
    )


def _diffs_in_words(row: dict) -> str:
    """The predictive variance's and the evidence's relative differences."""
    diffs = row.get("rel_diffs")
    if diffs is None:
        return f"{row.get('rel_diff', 0.0):.1e}"
    return f"{diffs['var']:.1e} / {diffs['evidence']:.1e}"


def report(results: dict) -> str:
    """The Markdown table of ``results``."""
    meta, floor = results["meta"], results["floor"]
    device = meta.get("device", "cpu")
    model = (
        "torchvision's ResNet-18 with the CIFAR stem (no max pooling"
        if meta.get("model") == "resnet18-cifar"
        else "torchvision's ResNet (one BasicBlock per stage, no batch norm"
    )
    memory = (
        "the CUDA allocator's peak above its value"
        if device.startswith("cuda")
        else "resident memory above its value"
    )
    lines = [
        "# `ContextPosterior` on a CIFAR ResNet within the memory budget",
        "",
        f"Generated by `python benchmarks/context_posterior/context_budget.py`: "
        f"{model}, 10 classes, P = {floor['P']:,}), random 3 × 32 × 32 images, "
        f"classification, on `{device}`, {meta['threads']} threads, torch "
        f"{meta['torch']}, {meta['machine']}, {meta['date']}. Each row a fresh "
        f"process; peak: {memory} before `fit` (before the call, for steps). "
        "dtype: the posterior's `compute_dtype`. The floor: "
        "one Jacobian pass over the data (measured on 16 images) plus P·M·C² "
        "multiply-adds per image at the matmul rate of the row's dtype, both "
        "measured in the same run as the row ("
        + _floors_in_words(results["rows"], floor)
        + "). `rel. diff`: the largest relative difference of the predictive "
        "variance / of the evidence to the same M's float64 row under the "
        f"`{meta.get('reference', 'none')}` budget. GFLOP/s: the matmul-like "
        "kernels of one more, untimed run of the same call (the fit; for steps, "
        "the whole `optimize_locations` call, the training cache included), "
        "counted by `torch.utils.flop_counter`, over the timed run's seconds, and "
        "its share of the matmul rate above (issue #42, item 2).",
    ]
    if any(row["path"] == "fit" for row in results["rows"]):
        lines += [
            "",
            "| M | N | budget | dtype | plan | fit s | floor s | fit / floor "
            "| GFLOP/s (% of matmul) | predict 64 s | peak GiB | rel. diff |",
            "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
    steps = [row for row in results["rows"] if row["path"] == "step"]
    for row in results["rows"]:
        if row["path"] != "fit":
            continue
        if "error" in row:
            lines.append(
                f"| {row['locations']} | {row['n_data']} | {row['budget']} | "
                f"{row.get('dtype', 'float64')} | {row['error']} | – | – | – | – "
                "| – | – | – |"
            )
            continue
        floor_s = _floor_s(row.get("floor", floor), row)
        lines.append(
            f"| {row['locations']} | {row['n_data']} | {row['budget']} | "
            f"{row.get('dtype', 'float64')} | {row['plan']} | {row['fit_s']:.1f} | "
            f"{floor_s:.1f} | {row['fit_s'] / floor_s:.2f} | "
            f"{_rate(row, 'fit', floor)} | "
            f"{row['predict_s']:.2f} | {row['peak_gib']:.2f} | "
            f"{_diffs_in_words(row)} |"
        )
    if steps:
        lines += [
            "",
            "`optimize_locations`, three steps of the Nyström gap from the first M "
            "images, seconds a step (the mean of the last two), against one "
            f"minibatch's Jacobian pass at the rate above; peak: {memory} "
            "before the call (the training cache included); "
            "`rel. diff`: the locations and the objective of each step against the "
            f"`{meta.get('reference', 'none')}` row (the model is float32).",
            "",
            "| M | N | minibatch | budget | plan | s a step | Jacobian pass s "
            "| step / pass | GFLOP/s (% of matmul) | peak GiB | rel. diff |",
            "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
        ]
    for row in steps:
        head = f"| {row['locations']} | {row['n_data']} | {row['minibatch']} | "
        if "error" in row:
            lines.append(
                head + f"{row['budget']} | {row['error']} | – | – | – | – | – | – |"
            )
            continue
        jac = row["minibatch"] * row.get("floor", floor)["jacobian_s_per_input"]
        lines.append(
            head
            + f"{row['budget']} | {row['plan']} | {row['step_s']:.1f} | {jac:.1f} | "
            f"{row['step_s'] / jac:.2f} | {_rate(row, 'total', floor)} | "
            f"{row['peak_gib']:.2f} | "
            f"{row.get('rel_diff', 0.0):.1e} |"
        )
    return "\n".join(lines) + "\n"


def _rate(row: dict, what: str, floor: dict) -> str:
    """Achieved GFLOP/s of ``what`` (``fit``: the fit; ``total``: the whole
    ``optimize_locations`` call) and its share of the row's matmul rate."""
    if f"{what}_gflop" not in row:
        return "–"
    rate = row[f"{what}_gflop"] / row[f"{what}_s"]
    share = 100 * rate * 1e9 / row.get("floor", floor)["flops_per_s"]
    return f"{rate:.3g} ({share:.0f} %)"


def _configs(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """``(path, settings)`` of every row group, in order (quick: small sizes)."""
    configs = []
    if "fit" in args.paths:
        sizes = sorted({min(m, 4) for m in args.locations}) if args.quick else None
        for m in sizes or args.locations:
            configs.append(("fit", {"path": "fit", "locations": m}))
    if "step" in args.paths:
        quick = args.quick
        step = {
            "path": "step",
            "locations": 3 if quick else args.step_locations,
            "minibatch": 8 if quick else args.minibatch,
            "n_data": 16 if quick else args.step_data,
        }
        configs.append(("step", step))
    return configs


def main(argv: list[str] | None = None) -> dict:
    """Run the rows, each in a fresh process, and write the JSON and the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--locations", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--n-data", type=int, default=512)
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS))
    parser.add_argument(
        "--dtypes", nargs="+", default=["float64"], choices=["float64", "float32"]
    )
    parser.add_argument("--paths", nargs="+", default=["fit", "step"])
    parser.add_argument("--step-locations", type=int, default=32)
    parser.add_argument("--minibatch", type=int, default=128)
    parser.add_argument("--step-data", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--model", default="resnet", choices=["resnet", "resnet18-cifar"]
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    if args.worker:
        cfg = json.loads(args.worker)
        if cfg.get("floor"):
            row = measure_floor(cfg)
        else:
            row = measure_step(cfg) if cfg["path"] == "step" else measure_row(cfg)
        print(json.dumps(row))
        return row
    import tempfile

    import torch

    base = {"quick": args.quick, "threads": args.threads, "n_data": args.n_data}
    base.update(device=args.device, model=args.model)
    if args.quick:
        base["n_data"] = min(args.n_data, 24)
    dtypes = list(dict.fromkeys(["float64", *args.dtypes]))
    floors = {d: _fresh(dict(base, floor=True, dtype=d), args.timeout) for d in dtypes}
    meta = {
        "device": args.device,
        "model": args.model,
        "reference": args.budgets[0],
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "quick": args.quick,
    }
    rows: list[dict] = []
    results: dict = {}
    out = {"meta": meta, "floor": floors["float64"], "rows": rows}
    with tempfile.TemporaryDirectory() as tmp:
        for path, cfg_path in _configs(args):
            m = cfg_path["locations"]
            # the optimiser's step computes in the model's dtype: float64 rows only
            for dtype in args.dtypes if path == "fit" else ["float64"]:
                for budget in args.budgets:
                    result = str(Path(tmp) / f"{path}-{m}-{budget}-{dtype}.pt")
                    cfg = dict(
                        base, **cfg_path, budget=budget, result=result, dtype=dtype
                    )
                    row = _fresh(cfg, args.timeout)
                    row.pop("result", None)
                    row["floor"] = floors[dtype]
                    rows.append(row)
                    if "error" not in row:
                        results[(path, m, budget, dtype)] = torch.load(result)
                    print(json.dumps(row), flush=True)
                    # written after every row: a run cut short keeps what it did
                    _compare(rows, results, reference=args.budgets[0])
                    out = dict(out, rows=list(rows))
                    _write(out, args)
    return out


def _write(out: dict, args: argparse.Namespace) -> None:
    """Write ``out`` (its rows keep the floor of their run), merged with the rows of
    the paths not run now, as JSON and (not quick) as the Markdown table."""
    for row in out["rows"]:
        row.setdefault("floor", out["floor"])  # against the floor of its run
    target = args.out or (None if args.quick else HERE / "context_budget.json")
    if target is None:
        return
    if target.exists() and not args.quick:
        earlier = json.loads(target.read_text())
        kept = [r for r in earlier["rows"] if r["path"] not in args.paths]
        for row in kept:
            row.setdefault("floor", earlier["floor"])
        out["rows"] = kept + out["rows"]
    target.write_text(json.dumps(out, indent=1) + "\n")
    markdown = args.markdown
    if markdown is None and args.out is None and not args.quick:
        markdown = HERE / "CONTEXT_BUDGET.md"
    if markdown is not None:
        markdown.write_text(report(out))


if __name__ == "__main__":
    main()
