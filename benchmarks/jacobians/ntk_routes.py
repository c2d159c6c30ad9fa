"""``ntk(x, x)`` and its gradient: the per-layer factor route against the others.

One run, one process, the same weights and inputs for every route, so the ratios
compare like with like. Routes:

* ``default``: :func:`laplace_diffjac.kernels.ntk` as a user calls it: the route
  its counted work estimates cheaper on this device (``kernels/_route_costs.py``),
  recorded as ``took``;
* ``factors``: ``DiffBackPackGGN`` + ``ntk(..., structured=True)`` on a model
  written as a class (the per-layer factor route, never forming ``J``; a chain
  of Linear layers' factors regrouped as layer features);
* ``sequential``: the same weights as an ``nn.Sequential``, MLP only: the same
  route since there is one walker of the model (the engine), so the two should
  take the same time;
* ``jacobians``: ``ntk(..., structured=False)``, forming ``J`` (B·C·P) and
  contracting it;
* ``torch.func vmap(jacrev)``: the Jacobian-contraction recipe of PyTorch's NTK
  tutorial;
* ``torch.func NTK-vector products``: that tutorial's ``vmap(jvp ∘ vjp)`` recipe.

The step timed is what a location optimiser waits for: the Gram and the gradient of
``Σ K²`` in ``x`` (in the parameters for the transformer, whose inputs are
tokens). Median of ``--repeats`` interleaved runs (every route once per round,
each round in its own shuffled order) after one warm-up, seconds.

Every route's Gram is compared with the factor route's (``max relative difference
to factors``), so a fast wrong route shows.

Beside each time, the work: ``gflop`` counted by ``torch.utils.flop_counter`` in
one more, untimed step (matmul-like kernels only, forward and backward; see
:func:`measure.counted_flops`), the rate it achieved, and that rate against a
square float32 matmul timed in the same process (``matmul_gflop_per_s``, the
practical ceiling). For the ``factors`` and ``jacobians`` routes also
``model_gmac``: the multiply-adds of the Gram's contraction alone (forward, no
engine passes) by the package's own cost model, the one that picks each
parameter's route (``kernels/_factor_gram.py``: ``gram_multiply_adds``, and
``jacobian_gram_multiply_adds``, writing ``J`` and ``J Jᵀ``).

Each ``--allocator`` setting (``default``, ``thp``, ``mmap-off``; :mod:`allocator`)
runs in a fresh process of its own, started in that setting's environment;
``--device cuda`` puts models and inputs on the GPU. ``--markdown FILE`` writes the
report (:mod:`ntk_report`); ``--report-from FILE.json`` renders it again.

Run: ``python benchmarks/jacobians/ntk_routes.py [--quick] [--out FILE.json]`` (its
recorded run: ``ntk_routes.json`` beside this script, read in ``NTK_ROUTES.md``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, ROOT]  # the harness beside it, and this checkout's package

import torch  # noqa: E402
from allocator import ALLOCATORS, applied, process_environment  # noqa: E402
from measure import (  # noqa: E402
    counted_flops,
    matmul_gflop_per_s,
    matmul_size,
    synchronized,
)  # noqa: E402
from ntk_report import render  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import functional_call, jacrev, jvp, vjp, vmap  # noqa: E402

from laplace_diffjac import DiffBackPackGGN  # noqa: E402
from laplace_diffjac.kernels import ntk  # noqa: E402
from laplace_diffjac.kernels._factor_gram import (  # noqa: E402
    gram_multiply_adds,
    jacobian_gram_multiply_adds,
)
from laplace_diffjac.kernels._ntk import (  # noqa: E402
    _gram_route,
    n_jacobian_columns,
    prior_variance,
)


class ClassMLP(nn.Module):
    """A tanh MLP written as a class, sharing the layers of an ``nn.Sequential``."""

    def __init__(self, chain: nn.Sequential) -> None:
        super().__init__()
        self.hidden = nn.ModuleList(m for m in chain[:-1] if isinstance(m, nn.Linear))
        self.out = chain[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


class SmallCNN(nn.Module):
    """Two 3×3 convolutions (16 and 32 channels) and a Linear head on 1×8×8."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 32, 3)
        self.head = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        return self.head(torch.relu(self.conv2(h)).flatten(1))


class TinyTransformer(nn.Module):
    """Token embeddings (vocabulary 1,000), one encoder layer, mean-pooled head."""

    def __init__(self, vocab: int = 1000, width: int = 32, length: int = 16) -> None:
        super().__init__()
        self.tokens, self.positions = (
            nn.Embedding(vocab, width),
            nn.Embedding(length, width),
        )
        self.encoder = nn.TransformerEncoderLayer(
            width, 4, 64, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        where = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        return self.head(self.encoder(self.tokens(x) + self.positions(where)).mean(1))


def _func_jacobian_ntk(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = {k: v for k, v in model.named_parameters()}

    def single(p, xi):
        return functional_call(model, p, (xi[None],))[0]

    J = vmap(jacrev(single), (None, 0))(params, x)
    flat = torch.cat([j.flatten(2) for j in J.values()], dim=2)
    return torch.einsum("acp,bep->abce", flat, flat)


def _func_ntk_vector_products(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = {k: v for k, v in model.named_parameters()}
    n_out = model(x[:1]).shape[1]
    basis = torch.eye(n_out, dtype=x.dtype, device=x.device)

    def one_pair(x1, x2):
        def f1(p):
            return functional_call(model, p, (x1[None],))[0]

        def f2(p):
            return functional_call(model, p, (x2[None],))[0]

        def column(v):
            (pullback,) = vjp(f2, params)[1](v)
            return jvp(f1, (params,), (pullback,))[1]

        return vmap(column)(basis).T

    return vmap(vmap(one_pair, (None, 0)), (0, None))(x, x)


def _step(route: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    leaf = x.detach().clone().requires_grad_(x.is_floating_point())
    with warnings.catch_warnings():
        # torch.func's vmap on attention it cannot batch: slow, said by the timing
        warnings.filterwarnings(
            "ignore", message="There is a performance drop", category=UserWarning
        )
        K = route(leaf)
    (K * K).sum().backward()


def _routes(name: str, model: nn.Module) -> dict[str, Callable]:
    backend = DiffBackPackGGN(model, "classification")
    chooser = DiffBackPackGGN(model, "classification")  # its own counts and choice
    routes: dict[str, Callable] = {
        "default": lambda x: ntk(chooser, x),
        "factors": lambda x: ntk(backend, x, structured=True),
        "jacobians": lambda x: ntk(backend, x, structured=False),
        "torch.func vmap(jacrev)": lambda x: _func_jacobian_ntk(model, x),
        "torch.func NTK-vector products": lambda x: _func_ntk_vector_products(model, x),
    }
    if name == "mlp":
        chain = nn.Sequential(
            *[m for layer in model.hidden for m in (layer, nn.Tanh())], model.out
        )
        sequential = DiffBackPackGGN(chain, "classification")
        routes["sequential"] = lambda x: ntk(sequential, x)
    return routes


def _cases(quick: bool) -> dict[str, tuple[nn.Module, torch.Tensor, str]]:
    """Each case's model, inputs and description."""
    torch.manual_seed(0)
    width, batch = (32, 16) if quick else (128, 64)
    chain = nn.Sequential(
        nn.Linear(20, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, 10),
    )
    gen = torch.Generator().manual_seed(1)
    cnn_batch, tokens = (8, 8) if quick else (128, 64)
    return {
        "mlp": (
            ClassMLP(chain),
            torch.randn(batch, 20, generator=gen),
            f"MLP 20-{width}-{width}-10 tanh (class)",
        ),
        "cnn": (
            SmallCNN(),
            torch.randn(cnn_batch, 1, 8, 8, generator=gen),
            "CNN 1×8×8, conv 16/32, C=10",
        ),
        "transformer": (
            TinyTransformer().eval(),
            torch.randint(0, 1000, (tokens, 16), generator=gen),
            "transformer, vocabulary 1,000, T=16, width 32",
        ),
    }


def _model_gmac(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """The package's cost model: multiply-adds of the Gram's contraction, GMAC."""
    backend = DiffBackPackGGN(model, "classification")
    params = list(backend.params)
    with torch.no_grad():
        factors = backend.jacobian_factors(x)
    one = torch.ones((), dtype=factors.f.dtype, device=factors.f.device)
    return {
        "factors": gram_multiply_adds(factors, factors, params, one) / 1e9,
        "jacobians": jacobian_gram_multiply_adds(factors, factors, params) / 1e9,
    }


def _route_taken(model: nn.Module, x: torch.Tensor) -> str:
    """The route ``ntk``'s default takes for the step, asked of a fresh backend."""
    backend = DiffBackPackGGN(model, "classification")
    leaf = x.detach().requires_grad_(x.is_floating_point())
    n = int(x.shape[0])
    first = next(model.parameters())  # the prior in the model's dtype, not x's
    prior_var = prior_variance(
        1.0,
        n_jacobian_columns(backend),
        torch.empty((), dtype=first.dtype, device=first.device),
    )
    factors, _, _ = _gram_route(
        backend, True, True, leaf, (n, n), True, True, prior_var, None, 256
    )
    return "factors" if factors else "jacobians"


def _time_routes(
    working: dict[str, Callable], x: torch.Tensor, repeats: int
) -> dict[str, float]:
    """Median seconds of every route's step, interleaved round after round.

    Interleaved, so that drift on the machine hits every route; each round in
    its own order (a seeded shuffle), so that no route always runs right after
    the same other one: a route that leaves the allocator's heap in a bad state
    (the NTK-vector products' ``vmap``) slowed whichever route came next by up
    to 2× (in a fixed order, the class and the ``nn.Sequential`` MLP, one
    route, took 1.0× and 2.0× the factor route's time).
    """
    times: dict[str, list[float]] = {route: [] for route in working}
    order = list(working)
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)
        for route in order:
            start = time.perf_counter()
            working[route](x)
            times[route].append(time.perf_counter() - start)
    return {route: statistics.median(values) for route, values in times.items()}


def run_case(
    name: str, model: nn.Module, x: torch.Tensor, repeats: int, device: torch.device
) -> dict[str, dict]:
    """Every route of one case: seconds, FLOPs and the difference to factors."""
    rows: dict[str, dict] = {}
    routes = _routes(name, model)
    with torch.no_grad():
        reference = routes["factors"](x).double()  # the package's: no warnings
    working: dict[str, Callable] = {}
    for route, fn in routes.items():  # warm-up, and which routes run at all
        step = synchronized(lambda fn=fn: _step(fn, x), device)
        try:
            step()
        except (RuntimeError, NotImplementedError) as err:
            rows[route] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        else:
            working[route] = lambda _, step=step: step()
    seconds = _time_routes(working, x, repeats)
    modelled = _model_gmac(model, x)
    scale = reference.abs().max()
    for route, fn in working.items():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="There is a performance drop")
            gram = routes[route](x).double()
        gflop = counted_flops(lambda fn=fn: fn(x)) / 1e9
        rows[route] = {
            "seconds": seconds[route],
            "max relative difference to factors": float(
                (gram - reference).abs().max() / scale
            ),
            "gflop": gflop,
            "gflop_per_s": gflop / seconds[route],
        }
        if route in modelled:
            rows[route]["model_gmac"] = modelled[route]
    if "seconds" in rows.get("default", {}):
        rows["default"]["took"] = _route_taken(model, x)
    base = rows["factors"]["seconds"]
    for row in rows.values():
        if "seconds" in row:
            row["vs factors"] = row["seconds"] / base
    return rows


def run(quick: bool = False, repeats: int = 3, device: str = "cpu") -> dict:
    """Time every route on every case in this process; seconds, ratios, FLOPs."""
    where = torch.device(device)
    results: dict = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "device": str(where),
        "matmul_gflop_per_s": matmul_gflop_per_s(where, matmul_size(where, quick)),
        "cases": {},
    }
    if where.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(where)
    for name, (model, x, description) in _cases(quick).items():
        model, x = model.to(where), x.to(where)
        results["cases"][name] = {
            "description": description,
            "batch": int(x.shape[0]),
            "routes": run_case(name, model, x, repeats, where),
        }
    return results


def _run_fresh(setting: str, args: argparse.Namespace) -> dict:
    """One allocator setting in a fresh process started in its environment."""
    command = [sys.executable, os.path.abspath(__file__), "--setting", setting]
    command += ["--repeats", str(args.repeats), "--device", args.device]
    command += ["--quick"] if args.quick else []
    env = process_environment(setting)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p
    )
    proc = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=args.timeout
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{setting}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="the results, JSON")
    parser.add_argument("--markdown", default=None, help="the report, Markdown")
    parser.add_argument(
        "--allocator", nargs="+", choices=ALLOCATORS, default=["default"]
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per setting, s")
    parser.add_argument("--report-from", default=None, help="render a saved JSON")
    parser.add_argument("--setting", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    if args.setting is not None:  # one setting, in this fresh process
        with applied(args.setting):
            result = run(args.quick, args.repeats, args.device)
        print("RESULT " + json.dumps({"allocator": args.setting, **result}))
        return result
    if args.report_from:
        with open(args.report_from) as handle:
            results = json.load(handle)
    else:
        runs = [_run_fresh(setting, args) for setting in args.allocator]
        command = ["python benchmarks/jacobians/ntk_routes.py", *sys.argv[1:]]
        results = {
            "command": " ".join(command if argv is None else command[:1] + argv),
            "date": datetime.datetime.now().isoformat(timespec="minutes"),
            "quick": args.quick,
            "repeats": args.repeats,
            "runs": runs,
        }
    text = json.dumps(results, indent=2)
    if args.out and not args.report_from:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(render(results))
    print(text)
    return results


if __name__ == "__main__":
    main()
