"""What a posterior's uncertainty is for: the study's parts beyond in-distribution NLPD.

A *part* names its data (``ood``: digits trained on classes 0–4, the test inputs of
5–9 out-of-distribution; ``shift``: every data set, test inputs corrupted at
increasing severity, ``corruptions.py``) and a *probe*, which turns the latent
variances of a fitted posterior on the part's input sets into metrics:
out-of-distribution AUROC from the predictive entropy and from the latent variance;
NLPD, ECE, accuracy (RMSE for regression) per corruption and severity; selective
prediction (AURC and the accuracy–coverage curve) on every classification set.
The fits are the study's (``evaluate.evaluate_seed`` calls the probe per row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from laplace_diffjac import DiffBackPackGGN

from .context import SeedContext
from .corruptions import shifted_test_sets
from .data import Split, load_split
from .metrics import accuracy_coverage, aurc, auroc, entropy
from .predictive import predictive_metrics, probit

__all__ = ["IN_CLASSES", "PARTS", "ProbeSet", "make_probe", "part_split"]

#: Classes the ``ood`` part trains on (digits 0–4); the others are out-of-distribution.
IN_CLASSES = (0, 1, 2, 3, 4)
PARTS = ("ood", "shift")


@dataclass
class ProbeSet:
    """Inputs a probe evaluates: Jacobians ``(n, C, P)``, MAP outputs, labels."""

    name: str  # 'ood' or '<corruption>@<severity>'
    corruption: str
    severity: float
    jac: torch.Tensor
    f: torch.Tensor
    y: torch.Tensor | None  # None for out-of-distribution inputs
    _projected: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def projected(self, eigenvectors: torch.Tensor) -> torch.Tensor:
        """``J V`` in float64 (cached: the full Laplace needs it at two δ)."""
        key = id(eigenvectors)
        if key not in self._projected:
            self._projected = {key: self.jac.double() @ eigenvectors}
        return self._projected[key]


def part_split(name: str, seed: int, part: str) -> Split:
    """The split of a part (``ood``: digits' classes 0–4 only; else all classes)."""
    if part == "ood":
        if name != "digits":
            raise ValueError(f"The ood part runs on digits only, not {name!r}.")
        return load_split(name, seed, keep_classes=IN_CLASSES)
    return load_split(name, seed)


def _sets(ctx: SeedContext, part: str) -> list[ProbeSet]:
    backend = DiffBackPackGGN(ctx.model, ctx.likelihood)

    def probe_set(name: str, kind: str, sev: float, x, y) -> ProbeSet:
        Js, f = backend.jacobians(x, enable_backprop=False)
        return ProbeSet(name, kind, sev, Js.detach(), f.detach(), y)

    split = ctx.split
    if part == "ood":
        if split.x_ood is None:
            raise ValueError("The ood part needs a split with held-out classes.")
        return [probe_set("ood", "ood", 1.0, split.x_ood, None)]
    return [
        probe_set(f"{kind}@{sev:g}", kind, sev, x, split.y_test)
        for kind, levels in shifted_test_sets(split, ctx.seed).items()
        for sev, x in levels
    ]


def _selective(probs: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> dict:
    correct = probs.argmax(dim=1) == y.long()
    ent, lat = entropy(probs), var.double().mean(dim=1)
    return {
        "aurc_entropy": aurc(ent, correct),
        "aurc_variance": aurc(lat, correct),
        "acc_coverage": accuracy_coverage(ent, correct),
    }


def _scores(
    probs: torch.Tensor, var: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return entropy(probs), var.double().mean(dim=1)


def make_probe(
    ctx: SeedContext, part: str
) -> Callable[[Callable[[ProbeSet], torch.Tensor], float, torch.Tensor], dict]:
    """The probe of a part for one seed (its input sets' Jacobians computed once).

    Parameters
    ----------
    ctx : SeedContext
        The seed's network and split.
    part : {'ood', 'shift'}
        The part.

    Returns
    -------
    callable
        ``probe(var_of, sigma, var_test) -> {set name: {metric: value}}``, with
        ``clean`` for the test set itself (selective prediction).

    """
    if part not in PARTS:
        raise ValueError(f"Unknown part {part!r}; choose from {PARTS}.")
    sets = _sets(ctx, part)
    task, y_test = ctx.likelihood, ctx.split.y_test

    def probe(var_of: Callable[[ProbeSet], torch.Tensor], sigma: float, var_test):
        out: dict[str, Any] = {}
        if task == "classification":
            out["clean"] = _selective(probit(ctx.f_test, var_test), var_test, y_test)
        for s in sets:
            var = var_of(s)
            if s.y is None:  # out-of-distribution: AUROC against the clean test set
                ent_in, lat_in = _scores(probit(ctx.f_test, var_test), var_test)
                ent_out, lat_out = _scores(probit(s.f, var), var)
                labels = torch.cat([torch.zeros(len(ent_in)), torch.ones(len(ent_out))])
                out[s.name] = {
                    "auroc_entropy": auroc(torch.cat([ent_in, ent_out]), labels.bool()),
                    "auroc_variance": auroc(
                        torch.cat([lat_in, lat_out]), labels.bool()
                    ),
                }
                continue
            metrics: dict[str, Any] = predictive_metrics(task, s.f, var, s.y, sigma)
            if task == "classification":
                metrics.update(_selective(probit(s.f, var), var, s.y))
            out[s.name] = {
                **metrics,
                "corruption": s.corruption,
                "severity": s.severity,
            }
        return out

    return probe
