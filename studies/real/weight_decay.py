"""Is the full Laplace under-confident only because the MAP's prior is not its own?

``python -m studies.real.weight_decay digits 17 1e-4,1.3e-3,5e-3`` trains the
study's MLP with each weight decay ``wd`` (Adam's coupled L2 on the mean loss, a
prior of precision ``wd · N_train`` on the sum loss), fits the full-data GGN
Laplace, and prints, per ``wd``: the prior precision the network was trained with,
the full Laplace's evidence maximiser ``δ_ev`` and its log evidence, and test
NLPD/accuracy/ECE of the MAP, of the full Laplace at ``δ_ev`` and at the training
precision. Where ``δ_ev ≈ wd · N_train`` the Laplace sits at the mode of the
posterior whose evidence it uses (MacKay's consistency); the study itself trains
with ``wd = 1e-4`` as SFR does.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import torch

from .context import build_context
from .data import load_split
from .evaluate import full_metrics
from .predictive import predictive_metrics
from .training import TrainConfig


def _rounded(metrics: dict) -> dict:
    return {k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)}


def main(argv: list[str]) -> None:
    """Print one JSON line per weight decay (arguments: data set, seed, wd list)."""
    name, seed, wds = argv[0], int(argv[1]), [float(w) for w in argv[2].split(",")]
    torch.set_num_threads(1)
    split = load_split(name, seed)
    n = split.x_train.shape[0]
    for wd in wds:
        start = time.perf_counter()
        ctx = build_context(split, seed, replace(TrainConfig(), weight_decay=wd))
        delta = ctx.full.best_delta()
        zero = torch.zeros_like(ctx.f_test, dtype=torch.float64)
        map_metrics = predictive_metrics(
            ctx.likelihood, ctx.f_test, zero, split.y_test, ctx.sigma_noise
        )
        record = {
            "weight_decay": wd,
            "delta_trained": wd * n,
            "delta_evidence": delta,
            "log_evidence": ctx.full.log_evidence(delta),
            "map": _rounded(map_metrics),
            "full_at_evidence": _rounded(full_metrics(ctx, delta)),
            "full_at_trained": _rounded(full_metrics(ctx, wd * n)),
            "seconds": round(time.perf_counter() - start),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
