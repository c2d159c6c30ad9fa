"""laplace-torch on the models people download: fit, one prediction, peak memory.

Per model and laplace-torch flavour, four backends side by side: laplace-torch's
default (what ``Laplace(...)`` picks without ``backend=``: ``CurvlinopsGGN`` in 0.3),
laplace-torch's ``BackPackGGN``, and this package's ``DiffBackPackGGN`` and
``DiffFuncGGN``, each reported as ratios to laplace-torch's default.

Models (``zoo_builders.py``; random weights, float32, eval mode): Hugging Face
GPT-2 and BERT (2 layers, width 128, 4 heads, vocabulary 1000, 32 tokens, 2
classes; ``BatchEncoding`` batches) and ViT (32×32 images, 4×4 patches, 2 layers,
width 128, 10 classes); GPT-2 + peft's LoRA on ``c_attn`` (r = 4); torchvision's
ResNet (``BasicBlock``, one per stage) and MobileNetV3-small (3×32×32, 10 classes).
Flavours: all weights × ``diag`` and ``kron``; last layer × ``full`` (GPT-2 with
``feature_reduction="pick_last"`` where laplace-torch has it, 0.3); a subnetwork
chosen by ``requires_grad`` (position embeddings, a norm and the head; P = 4.6k to
9.9k) × ``full``; LoRA × ``kron`` and ``full`` (laplace-torch's own Hugging Face
example's flavours). The torchvision models take ``diag`` and ``kron`` only (P = 4.9
and 1.5 million; all weights: GPT-2 and BERT 0.53-0.55 million, ViT 0.41 million,
LoRA 4096). Data: synthetic, generated here (seeded token ids, right-padded
and masked; normal pixels; random labels); N = 128 (64 for torchvision) in batches
of 16; test batches of 16 (8).

How: each configuration (model, flavour, backend) runs in a fresh process
(``--quick``: all of them in one), which sets ``torch.set_num_threads`` and
``OMP_NUM_THREADS`` to ``--threads`` (2), builds the model, the loader and the test
batch, resets its resident-memory high-water mark (``/proc/self/clear_refs``;
Linux) and measures the seconds of ``la.fit(loader)``, those of the first
prediction ``la(x_test, pred_type="glm")`` (with what laplace-torch computes lazily
there, such as a full posterior's scale), and the peak RSS above the RSS at the
reset (after the fit, and after the prediction). A backend that fails or refuses
gives a row with the stage, the file that raised and the exception's type and first
line; a process that dies or runs past ``--timeout`` seconds gives one as well. Each
backend's fitted ``la.H`` and predictive probabilities are compared with the
default's, so that a fast wrong route shows. Single cold runs.

Run: ``python benchmarks/zoo/zoo_flavours.py [--quick] [--out PATH] [--threads 2]
[--timeout 1800] [--models M ...]``; ``--models`` measures only those models and
keeps the other models' rows already in the output (the commands of every
invocation are recorded). Without ``--quick`` the results go to ``zoo_flavours.json``
and ``ZOO.md`` beside this script; ``--quick`` writes only where ``--out`` says
(``ZOO.md`` beside that JSON). ``--report-only`` writes ``ZOO.md`` again from the
JSON (``--out``, or the one beside this script).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from importlib.metadata import PackageNotFoundError, version

import torch
from zoo_builders import build, data  # benchmarks/zoo/ is on sys.path
from zoo_report import write_report

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]

BACKENDS = ("default", "BackPackGGN", "DiffBackPackGGN", "DiffFuncGGN")

_TEXT_SIZE = dict(layers=2, heads=4, width=128, vocab=1000, seq=32, classes=2)
SIZES = {
    "gpt2": _TEXT_SIZE,
    "bert": _TEXT_SIZE,
    "gpt2-lora": dict(_TEXT_SIZE, rank=4),
    "vit": dict(image=32, patch=4, layers=2, heads=4, width=128, classes=10),
    "resnet": dict(image=32, classes=10),
    "mobilenet": dict(image=32, classes=10),
}
_QUICK_TEXT = dict(layers=1, heads=2, width=16, vocab=50, seq=8, classes=2)
QUICK_SIZES = {
    "gpt2": _QUICK_TEXT,
    "bert": _QUICK_TEXT,
    "gpt2-lora": dict(_QUICK_TEXT, rank=2),
    "vit": dict(image=8, patch=4, layers=1, heads=2, width=16, classes=3),
    "resnet": dict(image=16, classes=2),
    "mobilenet": dict(image=16, classes=2, width_mult=0.25),
}
#: (N, batch, test inputs) of the full run and of ``--quick``, by kind of model.
DATA = {"transformer": (128, 16, 16), "torchvision": (64, 16, 8)}
QUICK_DATA = {"transformer": (8, 4, 2), "torchvision": (2, 2, 1)}
KIND = {
    "gpt2": "transformer",
    "bert": "transformer",
    "gpt2-lora": "transformer",
    "vit": "transformer",
    "resnet": "torchvision",
    "mobilenet": "torchvision",
}

#: Flavours: (name, subset_of_weights, hessian_structure, subnetwork).
ALL_DIAG = ("all × diag", "all", "diag", False)
ALL_KRON = ("all × kron", "all", "kron", False)
LAST_FULL = ("last layer × full", "last_layer", "full", False)
SUBNET_FULL = ("subnetwork × full", "all", "full", True)
LORA_KRON = ("LoRA × kron", "all", "kron", False)
LORA_FULL = ("LoRA × full", "all", "full", False)
FLAVOURS = {
    "gpt2": [ALL_DIAG, ALL_KRON, LAST_FULL, SUBNET_FULL],
    "bert": [ALL_DIAG, ALL_KRON, LAST_FULL, SUBNET_FULL],
    "vit": [ALL_DIAG, ALL_KRON, LAST_FULL, SUBNET_FULL],
    "gpt2-lora": [LORA_KRON, LORA_FULL],
    "resnet": [ALL_DIAG, ALL_KRON],
    "mobilenet": [ALL_DIAG, ALL_KRON],
}
#: ``--quick``: one flavour per model. torchvision's ``kron`` is left out: ResNet's
#: factors (up to 4608²) take their eigendecomposition's time at any input size.
QUICK_FLAVOURS = {
    "gpt2": [LAST_FULL],
    "bert": [ALL_KRON],
    "vit": [SUBNET_FULL],
    "gpt2-lora": [LORA_KRON],
    "resnet": [ALL_DIAG],
    "mobilenet": [ALL_DIAG],
}
#: The subnetwork by ``requires_grad``: parameters whose names start so.
SUBNETWORK = {
    "gpt2": (
        "hf_model.transformer.wpe.",
        "hf_model.transformer.ln_f.",
        "hf_model.score.",
    ),
    "bert": (
        "hf_model.bert.embeddings.position_embeddings.",
        "hf_model.bert.embeddings.LayerNorm.",
        "hf_model.classifier.",
    ),
    "vit": (
        "hf_model.vit.embeddings.position_embeddings",
        "hf_model.vit.layernorm.",
        "hf_model.classifier.",
    ),
}


def grid(quick: bool, models: list[str] | None = None) -> list[dict]:
    """Every configuration: model × flavour × backend (of ``models``, if given)."""
    flavours = QUICK_FLAVOURS if quick else FLAVOURS
    configs = []
    for model, chosen in flavours.items():
        if models and model not in models:
            continue
        size = (QUICK_SIZES if quick else SIZES)[model]
        n, batch, n_test = (QUICK_DATA if quick else DATA)[KIND[model]]
        for name, subset, structure, subnetwork in chosen:
            for backend in BACKENDS:
                configs.append(
                    dict(
                        model=model,
                        flavour=name,
                        subset=subset,
                        structure=structure,
                        subnetwork=subnetwork,
                        backend=backend,
                        size=size,
                        n=n,
                        batch=batch,
                        n_test=n_test,
                    )
                )
    return configs


# --- One configuration, in the worker process


def _rss_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, KiB (Linux)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Reset the peak RSS to the current RSS (``5`` into ``clear_refs``); KiB.

    Returns the reset peak (``VmHWM``), not ``VmRSS``: the kernel's RSS counters
    are synced lazily, so a ``VmRSS`` read after the reset may exceed the peak
    read later (CI saw a peak 192 KiB below it); differences of one counter
    cannot go negative.
    """
    gc.collect()
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    return _rss_kib("VmHWM")


def _peak_gib(base: int) -> float:
    """The peak RSS since :func:`_reset_peak` returned ``base`` (KiB) above it, GiB.

    A high-water mark cannot fall below its reset value, but the kernel's RSS
    counters are per-CPU sums synced in batches, so two reads can disagree by a
    few hundred KiB (CI saw -220 KiB on a warmed-up row whose own peak is
    nothing): a negative difference is that noise and is read as zero.
    """
    return max(_rss_kib("VmHWM") - base, 0) / 2**20


def _backend_class(name: str) -> type | None:
    """The class passed as ``backend=`` (``None``: laplace-torch's default)."""
    if name == "default":
        return None
    if name == "BackPackGGN":
        from laplace.curvature import BackPackGGN

        return BackPackGGN
    import laplace_diffjac  # registers the adapter with laplace-torch

    return getattr(laplace_diffjac, name)


def _laplace_kwargs(cfg: dict) -> dict:
    """``Laplace(...)``'s keywords; ``feature_reduction`` for GPT-2's last layer."""
    kwargs = dict(
        likelihood="classification",
        subset_of_weights=cfg["subset"],
        hessian_structure=cfg["structure"],
    )
    backend = _backend_class(cfg["backend"])
    if backend is not None:
        kwargs["backend"] = backend
    if cfg["model"] == "gpt2" and cfg["subset"] == "last_layer" and _has_reduction():
        kwargs["feature_reduction"] = "pick_last"
    return kwargs


def _has_reduction() -> bool:
    """Whether this laplace-torch has ``feature_reduction`` (0.3 and later)."""
    import inspect

    from laplace.lllaplace import LLLaplace

    return "feature_reduction" in inspect.signature(LLLaplace.__init__).parameters


def _error(exc: BaseException, stage: str) -> dict:
    """The exception's type and first line, the stage and the file that raised.

    A ``SystemExit`` (laplace-torch's ``symeig`` calls ``exit()`` when
    ``torch.linalg.eigh`` fails) is described by the exception it ended.
    """
    frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    files = [f for f in frames if not f.startswith("<")] or frames or [""]
    where = files[-1].split("site-packages/")[-1].replace(str(ROOT) + os.sep, "")
    prefix = ""
    if isinstance(exc, SystemExit) and exc.__context__ is not None:
        prefix, exc = "SystemExit (exit() called) after ", exc.__context__
    lines = str(exc).strip().splitlines()
    return {
        "error": f"{prefix}{type(exc).__name__}: {lines[0] if lines else ''}"[:300],
        "stage": stage,
        "where": where,
    }


def _curvature(la) -> torch.Tensor:
    """The fitted curvature: ``la.H`` (diagonal or matrix), or its Kronecker
    factors' diagonal."""
    H = getattr(la, "H_facs", None)
    H = la.H if H is None else H
    return (H if isinstance(H, torch.Tensor) else H.diag()).detach()


def measure(cfg: dict, numbers: str | None) -> dict:
    """Fit and one prediction of one configuration in this process."""
    from laplace import Laplace

    model = build(cfg["model"], cfg["size"])
    if cfg["subnetwork"]:
        prefixes = SUBNETWORK[cfg["model"]]
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(prefixes))
    loader, x_test = data(
        cfg["model"], cfg["size"], cfg["n"], cfg["batch"], cfg["n_test"]
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # the last layer's parameters are known once laplace-torch has found it in fit
    row: dict = {"n_params": None if cfg["subset"] == "last_layer" else trainable}
    try:
        kwargs = _laplace_kwargs(cfg)
    except Exception as exc:  # noqa: BLE001 (an import that fails: said in the row)
        return dict(row, **_error(exc, "import"))
    base = _reset_peak()
    caught: list[str] = []
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        try:
            stage = "construct"
            la = Laplace(model, **kwargs)
            stage = "fit"
            start = time.perf_counter()
            la.fit(loader)
            row["fit_s"] = time.perf_counter() - start
            row["fit_peak_gib"] = _peak_gib(base)
            row["backend_class"] = type(la.backend).__name__
            row["n_params"] = int(la.n_params)  # the last layer's, found in fit
            stage = "predict"
            start = time.perf_counter()
            probs = la(x_test, pred_type="glm")
            row["predict_s"] = time.perf_counter() - start
            row["peak_gib"] = _peak_gib(base)
            if numbers:
                torch.save({"probs": probs.detach(), "H": _curvature(la)}, numbers)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 (a failure is a result)
            row.update(_error(exc, stage))
        caught = sorted({str(w.message).splitlines()[0][:200] for w in records})
    row["warnings"] = caught
    return row


def worker(configs: list[dict], threads: int) -> list[dict]:
    """Each configuration in turn, in this process."""
    torch.set_num_threads(threads)
    rows = []
    for cfg in configs:
        start = time.perf_counter()
        row = measure(cfg, cfg.get("numbers"))
        rows.append(dict(row, measure_s=time.perf_counter() - start))
    return rows


# --- The parent: fresh processes, the JSON and the report


def _run(configs: list[dict], threads: int, timeout: float) -> list[dict]:
    """``configs`` in one fresh process; a row per configuration, whatever happens."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker"]
    command += [json.dumps(configs), "--threads", str(threads)]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return [
            {"error": f"timed out after {timeout:.0f} s", "stage": "process"}
        ] * len(configs)
    wall = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [""])[-1][:300]
        message = f"process exited with {done.returncode}: {tail}"
        return [{"error": message, "stage": "process"}] * len(configs)
    rows = json.loads(lines[-1])
    # the process's own share: its imports and start, spread over its rows
    start_s = (wall - sum(row["measure_s"] for row in rows)) / len(rows)
    return [dict(row, process_start_s=start_s) for row in rows]


def _agreement(rows: list[dict], numbers: dict[int, dict]) -> None:
    """Each row's curvature and predictive against the default's, where both exist.

    ``curvature_rel_diff_vs_default``: max |H - H_default| / max |H_default| of
    ``la.H`` (the diagonal of Kronecker factors); ``probs_abs_diff_vs_default``: max
    |p - p_default| of the predictive probabilities.
    """
    default = {
        (r["model"], r["flavour"]): i
        for i, r in enumerate(rows)
        if r["backend"] == "default"
    }
    for i, row in enumerate(rows):
        ref = default.get((row["model"], row["flavour"]))
        if ref is None or ref == i or i not in numbers or ref not in numbers:
            continue
        mine, theirs = numbers[i], numbers[ref]
        if mine["H"].shape == theirs["H"].shape:
            H, H_ref = mine["H"].double(), theirs["H"].double()
            scale = H_ref.abs().max().clamp_min(1e-300)
            row["curvature_rel_diff_vs_default"] = float(
                (H - H_ref).abs().max() / scale
            )
        p, p_ref = mine["probs"].double(), theirs["probs"].double()
        row["probs_abs_diff_vs_default"] = float((p - p_ref).abs().max())


def environment(threads: int, command: list[str]) -> dict:
    """Versions, threads, machine and the command of this run."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    packages = ("laplace-torch", "transformers", "peft", "torchvision")
    return {
        "command": " ".join(["python", *command]),
        "commit": commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{p: installed(p) for p in packages},
        "curvlinops": installed("curvlinops-for-pytorch"),
        "backpack": installed("backpack-for-pytorch"),
        "threads": threads,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(FLAVOURS),
        help="only these models; rows of the others already in --out are kept",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker), args.threads)))
        return
    out = args.out or (None if args.quick else HERE / "zoo_flavours.json")
    if args.report_only:
        write_report(json.loads(out.read_text()), out.with_name("ZOO.md"))
        return
    configs = grid(args.quick, args.models)
    rows, numbers = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, cfg in enumerate(configs):
            cfg["numbers"] = str(pathlib.Path(tmp) / f"{i}.pt")
        # one process per configuration; --quick: all in one (timings mean nothing)
        groups = [configs] if args.quick else [[c] for c in configs]
        for group in groups:
            for cfg, measured in zip(group, _run(group, args.threads, args.timeout)):
                rows.append(
                    dict({k: v for k, v in cfg.items() if k != "numbers"}, **measured)
                )
                print(json.dumps(rows[-1]), flush=True)
        for i, cfg in enumerate(configs):
            if pathlib.Path(cfg["numbers"]).exists():
                numbers[i] = torch.load(cfg["numbers"])
    _agreement(rows, numbers)
    command = [os.path.relpath(__file__, ROOT), *sys.argv[1:]]
    kept, commands = [], [command]
    if args.models and out and out.exists():  # the other models' rows stay
        previous = json.loads(out.read_text())
        kept = [r for r in previous["rows"] if r["model"] not in args.models]
        commands = previous["environment"].get("commands", []) + [command]
    results = {
        "environment": dict(environment(args.threads, command), commands=commands),
        "quick": args.quick,
        "rows": kept + rows,
    }
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        write_report(results, out.with_name("ZOO.md"))


if __name__ == "__main__":
    main()
