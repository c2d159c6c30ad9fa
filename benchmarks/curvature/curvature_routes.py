"""The GGN's diagonal and Kronecker factors on CIFAR ResNets and two Hugging Face
text models: time and peak memory.

One run measures, each row in a fresh process: this package's ``DiffBackPackGGN``
``diag`` and ``kron`` (exact GGN and Monte Carlo), curvlinops'
``KFACLinearOperator`` (``fisher_type`` ``type-2`` and ``mc``, all batches in one
operator, ``compute_kronecker_factors``; of the Linear and convolution layers'
parameters, as it takes no batch norm), and laplace-torch's ``CurvlinopsGGN`` and
``BackPackGGN`` ``diag`` and ``kron`` where they run, on torchvision's ResNet
(``BasicBlock``, one per stage, 4.9 million parameters, 10 classes) with batch norm
(eval mode) and without (``norm_layer=nn.Identity``), and without it for 100
classes (``resnet-nobn-c100``: 100 rows of the loss Hessian's square root, which
the engine sends back in chunks), on random 3×32×32 images and labels (seeded):
by default 256 images in batches of 128. And on the zoo's text models
(``benchmarks/zoo/zoo_builders.py``, imported; 2 layers, width 128, 4 heads,
vocabulary 1000, 32 tokens, 2 classes, random weights): ``gpt2-lora``, GPT-2 with
peft's LoRA (r = 8) on ``c_attn``, the LoRA factors the curvature's only
parameters (everything else ``requires_grad=False``, as in laplace-torch's Hugging
Face example), and ``bert``, BERT for sequence classification with all its
parameters (curvlinops' KFAC only of its Linear layers: it takes no embeddings and
no LayerNorm); dict-like batches (``BatchEncoding`` of ``input_ids``,
``attention_mask``, ``token_type_ids``; the zoo's seeded right-padded tokens) and
labels, by default 32 sequences in batches of 16 (KFAC gets ``batch_size_fn``).
The backends' methods are called once per batch, as laplace-torch's ``fit`` calls
them (without its eigendecompositions).

Per row: seconds of the curvature over all batches, and the peak resident memory
above the resident memory before them (the high-water mark reset through
``/proc/self/clear_refs``, Linux), after one warm-up call on two images that keeps
first-call costs (imports, lazy initialisation) out; each as a ratio to
curvlinops' ``type-2`` KFAC of the same model. A check number per row says what
was computed: the sum of the diagonal, or the sum over batches of the traces of
the Kronecker factors' products (``KFACLinearOperator``: its trace). A row whose
method fails, runs past ``--timeout`` or would form a Jacobian ``(B, C, P)``
larger than ``--max-jacobian-gib`` (laplace-torch's ``CurvlinopsGGN.diag``) says
so instead; each process's address space is capped at ``--memory-limit-gib``, so
that a row that would exhaust the machine fails instead. Single cold runs.

Run: ``python benchmarks/curvature/curvature_routes.py [--quick] [--threads 2]
[--models M ...] [--n N] [--batch B] [--out PATH]``; ``--quick`` runs 4 inputs in
batches of 2 (the text models at the zoo's quick sizes), all rows in one process
(timings mean nothing) and writes only where ``--out`` says. Without ``--quick``
the results go beside this script: to ``curvature_routes.json``, or, when only text
models are run, to ``curvature_routes_text.json``; ``CURVATURE_ROUTES.md`` beside
it reports both (beside any other ``--out``: that one's rows); ``--report-only``
writes the Markdown again from the JSON(s). laplace-torch's ``BackPackGGN`` fails
on torchvision's ``BasicBlock`` (BackPACK's backward hooks and its ``out +=
identity``) and on the text models (no BackPACK extension for the wrapper module;
on BERT its ``extend`` collides with ``BertLayer.output``), curvlinops' KFAC takes
no batch norm, and laplace-torch's ``CurvlinopsGGN.kron`` no BERT embeddings or
LayerNorm: their rows say so.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "jacobians"))
from fresh_process import run_worker  # noqa: E402

IMAGE_MODELS = ["resnet-nobn", "resnet-bn", "resnet-nobn-c100"]
#: The zoo's text models (``benchmarks/zoo/zoo_builders.py``), dict-like batches.
TEXT_MODELS = ["gpt2-lora", "bert"]
MODELS = IMAGE_MODELS + TEXT_MODELS
_TEXT = dict(layers=2, heads=4, width=128, vocab=1000, seq=32, classes=2)
#: The text models' sizes (``--quick``: ``QUICK_SIZES``), as the zoo's.
SIZES = {"gpt2-lora": dict(_TEXT, rank=8), "bert": _TEXT}
_QUICK_TEXT = dict(layers=1, heads=2, width=16, vocab=50, seq=8, classes=2)
QUICK_SIZES = {"gpt2-lora": dict(_QUICK_TEXT, rank=2), "bert": _QUICK_TEXT}
#: (N, batch) by kind of model, without ``--quick`` (``--n``/``--batch`` override).
DATA = {"image": (256, 128), "text": (32, 16)}
#: (method, variant): what each row runs.
ROWS = [
    ("DiffBackPackGGN", "diag"),
    ("DiffBackPackGGN", "kron"),
    ("DiffBackPackGGN", "diag-mc"),
    ("DiffBackPackGGN", "kron-mc"),
    ("KFACLinearOperator", "type-2"),
    ("KFACLinearOperator", "mc"),
    ("CurvlinopsGGN", "diag"),
    ("CurvlinopsGGN", "kron"),
    ("BackPackGGN", "diag"),
    ("BackPackGGN", "kron"),
]
REFERENCE = ("KFACLinearOperator", "type-2")


def classes(model: str, quick: bool = False) -> int:
    """Outputs of ``model``: a text model's size's, 100 for ``-c100``, else 10."""
    if model in TEXT_MODELS:
        return _size(model, quick)["classes"]
    return 100 if model.endswith("-c100") else 10


def _size(model: str, quick: bool) -> dict:
    return (QUICK_SIZES if quick else SIZES)[model]


def _zoo_builders():
    """``benchmarks/zoo/zoo_builders.py``: the zoo's text models and token rows."""
    zoo = str(HERE.parent / "zoo")
    if zoo not in sys.path:
        sys.path.insert(0, zoo)
    import zoo_builders

    return zoo_builders


def build(model: str, quick: bool = False):
    """torchvision's ResNet (one ``BasicBlock`` per stage), or the zoo's GPT-2 +
    LoRA (only the LoRA factors require gradients: peft freezes the rest) or BERT
    classifier; seeded, eval mode."""
    import torch
    from torch import nn
    from torchvision.models.resnet import BasicBlock, ResNet

    if model in TEXT_MODELS:
        return _zoo_builders().build(model, _size(model, quick), seed=0)

    torch.manual_seed(0)
    norm = nn.BatchNorm2d if model == "resnet-bn" else nn.Identity
    net = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=classes(model), norm_layer=norm)
    if model == "resnet-bn":  # running statistics away from their initial values
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return net.eval()


def batches(n: int, batch: int, n_classes: int, model: str = "", quick=False):
    """Seeded random images ``(batch, 3, 32, 32)`` and labels, or for a text model
    the zoo's token rows as ``BatchEncoding`` batches (``input_ids``,
    ``attention_mask``, ``token_type_ids``) and labels."""
    import torch

    if model in TEXT_MODELS:
        from torch.utils.data import default_collate
        from transformers import BatchEncoding

        rows = _zoo_builders().text_rows(n, _size(model, quick), 1)
        out = []
        for i in range(0, n, batch):
            x = BatchEncoding(default_collate(rows[i : i + batch]))
            out.append((x, x.pop("labels")))
        return out
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 32, 32, generator=gen)
    y = torch.randint(0, n_classes, (n,), generator=gen)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def _head(x, k: int):
    """The first ``k`` inputs of a tensor or a dict-like batch."""
    if hasattr(x, "shape"):
        return x[:k]
    from transformers import BatchEncoding

    return BatchEncoding({key: v[:k] for key, v in x.items()})


def _batch_size(x) -> int:
    return x.shape[0] if hasattr(x, "shape") else x["input_ids"].shape[0]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _rss_kib("VmRSS")


def _runner(method: str, variant: str, model, n: int):
    """A function of the batches that computes the row's curvature, and its check."""
    from torch import nn

    if method == "KFACLinearOperator":
        from curvlinops import KFACLinearOperator

        loss = nn.CrossEntropyLoss(reduction="sum")
        params = _kfac_params(model)

        def kfac(data: list) -> float:
            op = KFACLinearOperator(
                model, loss, params, data, fisher_type=variant,
                check_deterministic=False, num_data=sum(len(y) for _, y in data),
                batch_size_fn=_batch_size,
            )  # fmt: skip
            op.compute_kronecker_factors()
            return float(op.trace)

        return kfac
    backend = _backend(method, variant, model)
    structure = variant.split("-")[0]

    def curvature(data: list) -> float:
        check = 0.0
        for x, y in data:
            if structure == "diag":
                _, H = backend.diag(x, y)
                check += float(H.sum())
            else:
                _, K = backend.kron(x, y, N=n)
                check += float(K.diag().sum())
        return check

    return curvature


def _kfac_params(model) -> list:
    """The trainable parameters of the layers curvlinops' KFAC takes (Linear and
    convolution: not batch norm's, nor embeddings' or LayerNorm's)."""
    from torch import nn

    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    return [p for m in layers for p in m.parameters(recurse=False) if p.requires_grad]


def _backend(method: str, variant: str, model):
    stochastic = variant.endswith("-mc")
    if method == "DiffBackPackGGN":
        from laplace_diffjac import DiffBackPackGGN

        return DiffBackPackGGN(model, "classification", stochastic=stochastic)
    from laplace import curvature as lc

    return getattr(lc, method)(model, "classification", stochastic=stochastic)


def measure(cfg: dict) -> dict:
    """One row in this process."""
    import torch

    torch.set_num_threads(cfg["threads"])
    quick = cfg.get("quick", False)
    model = build(cfg["model"], quick)
    n_classes = classes(cfg["model"], quick)
    data = batches(cfg["n"], cfg["batch"], n_classes, cfg["model"], quick)
    row = {k: cfg[k] for k in ("model", "method", "variant", "n", "batch")}
    row["n_params"] = sum(p.numel() for p in model.parameters())
    if cfg["model"] in TEXT_MODELS:
        row["size"] = _size(cfg["model"], quick)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in trainable)  # the curvature's parameters
    row["n_params_curvature"] = n_params
    if cfg["method"] == "KFACLinearOperator":
        row["n_params_curvature"] = sum(p.numel() for p in _kfac_params(model))
    if (cfg["method"], cfg["variant"]) == ("CurvlinopsGGN", "diag"):
        gib = cfg["batch"] * n_classes * n_params * 4 / 2**30
        if gib > cfg["max_jacobian_gib"]:
            row["skipped"] = (
                f"laplace-torch's GGNInterface.diag forms J (B, C, P): {gib:.1f} GiB "
                f"per batch, above --max-jacobian-gib {cfg['max_jacobian_gib']}"
            )
            return row
    try:
        run = _runner(cfg["method"], cfg["variant"], model, cfg["n"])
        run([(_head(x, 2), y[:2]) for x, y in data[:1]])  # warm-up
        base = _reset_peak()
        start = time.perf_counter()
        row["check"] = run(data)
        row["seconds"] = time.perf_counter() - start
        row["peak_gib"] = max(_rss_kib("VmHWM") - base, 0) / 2**20
    except Exception as exc:  # noqa: BLE001 (a failure is a result)
        lines = str(exc).strip().splitlines()
        frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
        where = (frames[-1] if frames else "").split("site-packages/")[-1]
        row["error"] = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
        row["where"] = where
    return row


def _in_fresh_process(cfg: dict, timeout: float) -> dict:
    """``measure(cfg)`` in a new interpreter (``--worker``), with its own limits."""
    keys = ("model", "method", "variant", "n", "batch")
    limit = ["--memory-limit-gib", str(cfg["memory_limit_gib"])]
    return run_worker(Path(__file__).resolve(), cfg, timeout, keys, limit)


def _with_ratios(rows: list[dict]) -> list[dict]:
    """Time and peak as ratios to curvlinops' type-2 KFAC of the same model."""
    for row in rows:
        ref = next(
            (
                r
                for r in rows
                if r["model"] == row["model"]
                and (r["method"], r["variant"]) == REFERENCE
                and "seconds" in r
            ),
            None,
        )
        if ref is not None and "seconds" in row:
            row["time_ratio"] = row["seconds"] / ref["seconds"]
            row["peak_minus_reference_gib"] = row["peak_gib"] - ref["peak_gib"]
    return rows


def report(results: dict) -> str:
    """The Markdown tables of ``results``."""
    env = results["environment"]
    present = [m for m in MODELS if any(r["model"] == m for r in results["rows"])]
    text = all(m in TEXT_MODELS for m in present)
    what = "GPT-2 + LoRA and BERT" if text else "a CIFAR ResNet"
    inputs = "sequences" if text else "images"
    lines = [
        f"# The GGN's diagonal and Kronecker factors on {what}",
        "",
        f"Generated by `{results['command']}`: {env['n']} {inputs} in batches of "
        f"{env['batch']}, {env['threads']} thread(s), torch {env['torch']}, "
        f"{env['machine']}. Each row a fresh process, a single cold run after a "
        f"warm-up on two {inputs}; peak: resident memory above its value before "
        "the curvature"
        + (
            ""
            if text or not set(present) & set(TEXT_MODELS)
            else " (the text models: their own N and batch, below)"
        )
        + ". Ratios to curvlinops' "
        "`KFACLinearOperator(fisher_type='type-2')` of the same model.",
    ]
    for model in present:
        rows = [r for r in results["rows"] if r["model"] == model]
        lines += ["", f"## {model}", ""]
        if model in TEXT_MODELS:
            lines += [_text_note(model, rows), ""]
        lines += [
            "| method | variant | s | peak GiB | time / KFAC | peak − KFAC's (GiB) "
            "| check |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if "seconds" not in r:
                why = r.get("skipped") or r.get("error", "")
                why = why if len(why) <= 120 else why[:119] + "…"
                lines.append(
                    f"| {r['method']} | {r['variant']} | – | – | – | – | {why} |"
                )
                continue
            lines.append(
                f"| {r['method']} | {r['variant']} | {r['seconds']:.2f} | "
                f"{r['peak_gib']:.2f} | {r.get('time_ratio', float('nan')):.2f} | "
                f"{r.get('peak_minus_reference_gib', float('nan')):+.2f} | "
                f"{r['check']:.6g} |"
            )
    return "\n".join(lines) + "\n"


def _text_note(model: str, rows: list[dict]) -> str:
    """What a text model's section measured: its size and its parameters."""
    ours = next((r for r in rows if r["method"] == "DiffBackPackGGN"), rows[0])
    kfac = next((r for r in rows if r["method"] == "KFACLinearOperator"), ours)
    size = ours.get("size", SIZES[model])
    if model == "gpt2-lora":
        which = (
            f"GPT-2 with peft's LoRA (r = {size['rank']}) on `c_attn`; the "
            "curvature's parameters are the LoRA factors (the rest frozen, as in "
            "laplace-torch's Hugging Face example)"
        )
    else:
        which = (
            "BERT for sequence classification, all parameters; curvlinops' KFAC "
            "takes only its Linear layers (no embeddings, no LayerNorm), so its "
            "rows, and the ratios to them, cover fewer parameters than the others'"
        )
    return (
        f"The zoo's {which}: {size['layers']} layers, width {size['width']}, "
        f"{size['heads']} heads, vocabulary {size['vocab']}, {size['seq']} tokens, "
        f"{size['classes']} classes; {ours.get('n_params', '?')} parameters, "
        f"{ours.get('n_params_curvature', '?')} in the curvature, "
        f"{kfac.get('n_params_curvature', '?')} in KFAC's. N = "
        f"{ours.get('n', '?')} in batches of {ours.get('batch', '?')}: "
        "`BatchEncoding` (`input_ids`, `attention_mask`, `token_type_ids`), "
        "right-padded random tokens."
    )


def _default_out(models: list[str]) -> Path:
    """``curvature_routes.json``, or ``curvature_routes_text.json`` for text only."""
    if all(m in TEXT_MODELS for m in models):
        return HERE / "curvature_routes_text.json"
    return HERE / "curvature_routes.json"


def _write_markdown(out: Path) -> None:
    """``CURVATURE_ROUTES.md`` beside ``out``: its report, and beside this script
    both recorded JSONs' (the ResNets' and the text models')."""
    sources = [out]
    if out.parent == HERE:
        sources = [HERE / "curvature_routes.json", HERE / "curvature_routes_text.json"]
    texts = [report(json.loads(p.read_text())) for p in sources if p.exists()]
    (out.parent / "CURVATURE_ROUTES.md").write_text("\n".join(texts))


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run every row, write the JSON and the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n", type=int, help="inputs (256 images, 32 sequences)")
    parser.add_argument("--batch", type=int, help="batch size (128, 16)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--max-jacobian-gib", type=float, default=4.0)
    parser.add_argument("--memory-limit-gib", type=float, default=16.0)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report_only:
        _write_markdown(args.out or HERE / "curvature_routes.json")
        return
    if args.worker:  # a row that would exhaust the machine fails instead
        limit = int(args.memory_limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(measure(json.loads(args.worker))))
        return

    def sizes(model: str) -> tuple[int, int]:
        if args.quick:
            return 4, 2
        n, batch = DATA["text" if model in TEXT_MODELS else "image"]
        return args.n or n, args.batch or batch

    configs = [
        dict(
            model=m,
            method=method,
            variant=variant,
            n=sizes(m)[0],
            batch=sizes(m)[1],
            quick=args.quick,
            threads=args.threads,
            max_jacobian_gib=args.max_jacobian_gib,
            memory_limit_gib=args.memory_limit_gib,
        )  # fmt: skip
        for m in args.models
        for method, variant in ROWS
    ]
    rows = []
    for cfg in configs:
        row = measure(cfg) if args.quick else _in_fresh_process(cfg, args.timeout)
        print(json.dumps(row), flush=True)
        rows.append(row)
    import torch

    n, batch = sizes(args.models[0])  # a row's own: its "n" and "batch"
    results = {
        "command": " ".join(["python", "benchmarks/curvature/curvature_routes.py"]
                            + (argv if argv is not None else sys.argv[1:])),
        "environment": {
            "n": n, "batch": batch, "threads": args.threads,
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
        },
        "rows": _with_ratios(rows),
    }  # fmt: skip
    if args.quick and args.out is None:
        return
    out = args.out or _default_out(args.models)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    _write_markdown(out)


if __name__ == "__main__":
    main()
