"""``ntk(x, x)`` and its gradient: the per-layer factor route against the others.

One run, one process, the same weights and inputs for every route, so the ratios
compare like with like. Routes:

* ``factors``: ``DiffBackPackGGN`` + :func:`laplace_diffjac.kernels.ntk` on a model
  written as a class (the per-layer factor route, never forming ``J``);
* ``sequential``: the same weights as an ``nn.Sequential`` (the chain route of
  :func:`laplace_diffjac.kernels.structured_ntk`), MLP only;
* ``jacobians``: ``ntk(..., structured=False)``, forming ``J`` (B·C·P) and
  contracting it;
* ``torch.func vmap(jacrev)``: the Jacobian-contraction recipe of PyTorch's NTK
  tutorial;
* ``torch.func NTK-vector products``: that tutorial's ``vmap(jvp ∘ vjp)`` recipe.

The step timed is what a location optimiser waits for: the Gram and the gradient of
``Σ K²`` in ``x`` (in the parameters for the transformer, whose inputs are
tokens). Median of ``--repeats`` interleaved runs (every route once per round)
after one warm-up, seconds.

Every route's Gram is compared with the factor route's (``max relative difference
to factors``), so a fast wrong route shows.

Run: ``python benchmarks/jacobians/ntk_routes.py [--quick] [--out FILE.json]`` (its
recorded run: ``ntk_routes.json`` beside this script, read in ``NTK_ROUTES.md``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, jacrev, jvp, vjp, vmap

from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.kernels import ntk


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
        where = torch.arange(x.shape[1]).expand(x.shape[0], -1)
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
    basis = torch.eye(n_out, dtype=x.dtype)

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
    routes: dict[str, Callable] = {
        "factors": lambda x: ntk(backend, x),
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


def _cases(quick: bool) -> dict[str, tuple[nn.Module, torch.Tensor]]:
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
        "mlp": (ClassMLP(chain), torch.randn(batch, 20, generator=gen)),
        "cnn": (SmallCNN(), torch.randn(cnn_batch, 1, 8, 8, generator=gen)),
        "transformer": (
            TinyTransformer().eval(),
            torch.randint(0, 1000, (tokens, 16), generator=gen),
        ),
    }


def run(quick: bool = False, repeats: int = 3) -> dict:
    """Time every route on every case; seconds and ratios to the factor route."""
    results: dict = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "cases": {},
    }
    for name, (model, x) in _cases(quick).items():
        rows = {}
        routes = _routes(name, model)
        with torch.no_grad():
            reference = routes["factors"](x).double()  # the package's: no warnings
        working = {}
        for route, fn in routes.items():  # warm-up, and which routes run at all
            try:
                _step(fn, x)
            except (RuntimeError, NotImplementedError) as err:
                rows[route] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            else:
                working[route] = fn
        times: dict[str, list[float]] = {route: [] for route in working}
        for _ in range(repeats):  # interleaved: drift on the machine hits every route
            for route, fn in working.items():
                start = time.perf_counter()
                _step(fn, x)
                times[route].append(time.perf_counter() - start)
        scale = reference.abs().max()
        for route, fn in working.items():
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="There is a performance drop")
                gram = fn(x).double()
            rows[route] = {
                "seconds": statistics.median(times[route]),
                "max relative difference to factors": float(
                    (gram - reference).abs().max() / scale
                ),
            }
        base = rows["factors"]["seconds"]
        for row in rows.values():
            if "seconds" in row:
                row["vs factors"] = row["seconds"] / base
        results["cases"][name] = {"batch": int(x.shape[0]), "routes": rows}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = run(args.quick, args.repeats)
    text = json.dumps(results, indent=2)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
