"""Time the location optimiser and ``ContextPosterior.fit`` on digits, one thread.

``python benchmarks/optimizer/optimizer_speed.py [--quick] [--headline]`` writes
``OPTIMIZER.md`` (and ``OPTIMIZER.json``) beside this script. Data: scikit-learn's
``load_digits`` (standardised, the first 70 %: N = 1257, 64 features, 10 classes),
a ``64-w-w-10`` tanh MLP trained briefly with Adam (the timings do not depend on
how well it is trained). Everything runs in float32 with
``torch.set_num_threads(1)``; the Grams and Cholesky factors are float64.

Per configuration (M locations, hidden width w, so P parameters) it times one
optimiser step (minibatch of ``--batch`` inputs, forward and backward) on both
routes as :func:`laplace_diffjac.optimize_locations` runs them: the structured
route (per-layer features, training side cached once) and the J-forming route
(Jacobians of Z with graph; training Jacobians cached when under 512 MiB).
Then ``ContextPosterior.fit`` (J-forming today) beside the same ``K_ZX Λ K_XZ``
accumulation from per-layer features. Times are CPU seconds of this process
(``time.process_time``), the median over repeats, so that other processes on
a shared machine do not inflate them; wall seconds are listed beside them.
``--headline`` adds the end-to-end run of the issue: 200 steps at M = 126
(``--runs`` times, median); ``--keep-fits`` reuses the saved fit table;
``--report-from OPTIMIZER.json`` renders saved results again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from sklearn.datasets import load_digits

from laplace_diffjac.backends import as_backend
from laplace_diffjac.context import ContextPosterior, optimize_locations
from laplace_diffjac.context.locations._gap import batch_gap
from laplace_diffjac.context.locations._routes import make_route
from laplace_diffjac.context.locations._training_cache import (
    TrainingCache,
    training_hessians,
)
from laplace_diffjac.kernels import output_hessians
from laplace_diffjac.kernels._structured import structured_features
from laplace_diffjac.kernels._structured_features import feature_gram

HERE = os.path.dirname(os.path.abspath(__file__))


def digits(width: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A ``64-w-w-10`` tanh MLP trained 150 Adam steps on digits' first 70 %."""
    X, y = load_digits(return_X_y=True)
    X = (X - X.mean(0)) / (X.std(0) + 1e-8)
    n = int(0.7 * len(X))
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(X), generator=gen)[:n]
    x = torch.tensor(X, dtype=torch.float32)[perm]
    t = torch.tensor(y)[perm]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), t).backward()
        opt.step()
    return model.eval(), x, t


def _timed(fn, repeats: int) -> dict:
    fn()  # warm-up
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return {"cpu": statistics.median(cpu), "wall": statistics.median(wall)}


def step_time(model, x, m: int, batch: int, structured: bool, repeats: int) -> dict:
    """One optimiser step (forward + backward in Z) on one route."""
    backend = as_backend(model, "classification")
    route = make_route(backend, 1.0, structured, torch.device("cpu"))
    lam = training_hessians(model, x, "classification", 1.0, 1.0, 256)
    c0 = time.process_time()
    cache = TrainingCache(route, x, lam, None, 256)
    setup = time.process_time() - c0
    Z = x[:m].clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        idx = torch.randperm(len(x), generator=gen)[:batch]
        pieces, lam_b, trace = cache.batch(idx)
        loss = batch_gap(route, route.pieces(Z, graph=True), pieces, lam_b, trace, 1e-6)
        torch.autograd.grad(loss, Z)

    return {
        **_timed(step, repeats),
        "setup_cpu": setup,
        "cached": cache.pieces is not None,
    }


def fit_time(model, x, m: int, repeats: int) -> dict:
    """``ContextPosterior.fit`` beside the same accumulation from features."""
    Z = x[:m].clone()
    cp = ContextPosterior(model, "classification", Z)
    j = _timed(lambda: cp.fit(x), repeats)
    f64 = torch.float64

    def structured_fit() -> torch.Tensor:
        with torch.no_grad():
            fz = structured_features(model, Z).to(f64)
            B = torch.zeros(m * 10, m * 10, dtype=f64)
            for xb in torch.split(x, 256):
                fx = structured_features(model, xb).to(f64)
                f = model(xb).to(f64)
                lam = output_hessians(f, "classification")
                K_zx = feature_gram(fz, fx).reshape(m * 10, -1, 10)
                B += torch.einsum("kbc,bce,lbe->kl", K_zx, lam, K_zx)
        return 0.5 * (B + B.T)

    s = _timed(structured_fit, repeats)
    B_ref = cp._B  # the posterior's own accumulation, to check the numbers agree
    err = float((structured_fit() - B_ref).abs().max() / B_ref.abs().max())
    return {"jacobian": j, "structured": s, "max_rel_diff": err}


def headline(model, x, m: int, batch: int, steps: int) -> dict:
    """The issue's end-to-end run: ``optimize_locations`` for ``steps`` steps."""
    c, w = time.process_time(), time.perf_counter()
    r = optimize_locations(
        model,
        "classification",
        x,
        m,
        init="random",
        steps=steps,
        batch_size=batch,
        patience=0,
        progress_bar=False,
    )
    return {
        "cpu": time.process_time() - c,
        "wall": time.perf_counter() - w,
        "steps": len(r.history.objective),
        "batch": batch,
        "first": r.history.objective[0],
        "last_10_mean": statistics.mean(r.history.objective[-10:]),
    }


def _saved(output: str) -> dict:
    """The results of an earlier run (``OPTIMIZER.json`` beside ``output``)."""
    path = os.path.splitext(output)[0] + ".json"
    if not os.path.exists(path):
        raise SystemExit(f"--keep-fits needs an earlier run's {path}.")
    with open(path) as fh:
        return json.load(fh)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    widths = [10, 25] if args.quick else [25, 50, 100]
    ms = [5, 13] if args.quick else [13, 63, 126]
    rows, fits = [], []
    kept_fits = _saved(args.output).get("fits") if args.keep_fits else None
    configs = [(50 if not args.quick else 25, m) for m in ms]
    configs += [(w, ms[1]) for w in widths if w != configs[0][0]]
    for width, m in configs:
        model, x, _ = digits(width)
        if args.quick:
            x = x[:200]
        row = {"M": m, "width": width, "P": _n_params(model), "N": len(x)}
        for name, structured in (("structured", True), ("jacobian", False)):
            reps = args.repeats if structured else max(1, args.repeats // 2)
            row[name] = step_time(model, x, m, args.batch, structured, reps)
        rows.append(row)
        if kept_fits is None:
            fits.append({**row, **fit_time(model, x, m, max(1, args.repeats // 2))})
        print(f"M={m} P={row['P']}: done", flush=True)
    result = {
        "rows": rows,
        "fits": kept_fits if kept_fits is not None else fits,
        "fits_kept": kept_fits is not None,
        "batch": args.batch,
    }
    if args.headline:
        model, x, _ = digits(50)
        runs = [headline(model, x, 126, args.batch, 200) for _ in range(args.runs)]
        result["headline"] = {
            **runs[0],
            "cpu": statistics.median(r["cpu"] for r in runs),
            "wall": statistics.median(r["wall"] for r in runs),
            "cpu_runs": [r["cpu"] for r in runs],
            "wall_runs": [r["wall"] for r in runs],
        }
    return result


def _fmt_steps(rows: list) -> list[str]:
    lines = [
        "| M | width | P | structured CPU s/step (wall) | J-forming CPU s/step "
        "(wall) | J / structured | structured setup CPU s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s, j = r["structured"], r["jacobian"]
        lines.append(
            f"| {r['M']} | {r['width']} | {r['P']} | {s['cpu']:.3f} ({s['wall']:.3f}) "
            f"| {j['cpu']:.3f} ({j['wall']:.3f}) | {j['cpu'] / s['cpu']:.1f}x "
            f"| {s['setup_cpu']:.2f} |"
        )
    return lines


def _fmt_fits(fits: list) -> list[str]:
    lines = [
        "| M | P | N | fit, J-forming CPU s | same from features CPU s | ratio "
        "| max rel. diff |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in fits:
        j, s = f["jacobian"]["cpu"], f["structured"]["cpu"]
        lines.append(
            f"| {f['M']} | {f['P']} | {f['N']} | {j:.3f} | {s:.3f} | {j / s:.1f}x "
            f"| {f['max_rel_diff']:.1e} |"
        )
    return lines


def report(result: dict, args: argparse.Namespace) -> str:
    flags = (" --quick" if args.quick else "") + (
        " --headline" if args.headline else ""
    )
    cpu = platform.processor() or platform.machine()
    lines = [
        "# Location optimiser and ContextPosterior.fit: speed",
        "",
        f"Written by `python benchmarks/optimizer/optimizer_speed.py{flags}` on {cpu}, "
        f"torch {torch.__version__}, one thread. Digits (N as listed), 64-w-w-10 tanh "
        f"MLP, 10 classes, minibatch {result['batch']}. CPU seconds of the process "
        "(median of repeats; wall seconds in brackets, inflated when the machine is "
        "shared).",
        "",
        "## One optimiser step (forward + backward in Z)",
        "",
        *_fmt_steps(result["rows"]),
        "",
        "## ContextPosterior.fit (K_ZX Λ K_XZ over all N)",
        "",
        *_fmt_fits(result["fits"]),
        "",
        *(
            [
                "(This table is kept from the previous full run, `--keep-fits`: "
                "`ContextPosterior.fit` did not change since.)",
                "",
            ]
            if result.get("fits_kept")
            else []
        ),
        "`ContextPosterior.fit` forms `J` today. Where "
        "`laplace_diffjac.kernels.factor_route_applies(backend)` holds (a scalar "
        "prior, every parameter a Linear layer's) it "
        "could compute `fz = structured_features(model, Z)` once and, per batch, "
        "`feature_gram(fz, structured_features(model, xb), prior_var)` for `K_ZX` "
        "(`model(xb)` for `Λ`), `feature_gram(fz, fz, prior_var)` for `K_ZZ` and the "
        "same for `K_*Z` at prediction: the right-hand column, with the same numbers "
        "up to float32 rounding of the features.",
    ]
    if "headline" in result:
        h = result["headline"]
        lines += [
            "",
            "## The issue's run: 200 steps at M = 126 (10 % of N), width 50",
            "",
            "`optimize_locations(..., init='random', steps=200, "
            f"batch_size={h['batch']}, patience=0)`: {h['cpu']:.1f} CPU s "
            f"({h['wall']:.1f} s wall) for "
            f"{h['steps']} steps{_runs(h)}; minibatch objective {h['first']:.4g} at "
            f"the first step, {h['last_10_mean']:.4g} over the last ten.",
        ]
    return "\n".join(lines) + "\n"


def _runs(h: dict) -> str:
    if len(h.get("cpu_runs", [])) < 2:
        return ""
    cpu = ", ".join(f"{c:.1f}" for c in h["cpu_runs"])
    wall = ", ".join(f"{w:.1f}" for w in h["wall_runs"])
    return f" (median of {len(h['cpu_runs'])} runs: CPU s {cpu}; wall s {wall})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-size run")
    parser.add_argument("--headline", action="store_true", help="200 steps at M=126")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=1, help="headline runs (median)")
    parser.add_argument(
        "--keep-fits",
        action="store_true",
        help="reuse the ContextPosterior.fit table of the saved OPTIMIZER.json",
    )
    parser.add_argument("--output", default=os.path.join(HERE, "OPTIMIZER.md"))
    parser.add_argument("--report-from", help="render a saved OPTIMIZER.json again")
    args = parser.parse_args()
    if args.report_from:
        with open(args.report_from) as fh:
            result = json.load(fh)
    else:
        result = run(args)
    with open(args.output, "w") as fh:
        fh.write(report(result, args))
    with open(os.path.splitext(args.output)[0] + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
    print(report(result, args))


if __name__ == "__main__":
    main()
