"""Prior precision, observation noise and the prior's group structure.

laplace-torch accepts a prior precision as a scalar, one value per parameter tensor
("layerwise", ``n_layers`` values) or one per parameter ("diag", ``P`` values). The
context posterior needs, for each structure it must be able to change to after
``fit`` without a new pass over the data, accumulators per *group* of parameters
(see :mod:`laplace_diffjac.context.posterior._statistics`). A
:class:`PriorGroups` records the groups chosen at ``fit``:

* ``'scalar'``: one group, all parameters, unit weight. Any scalar precision
  ``δ`` scales the kernel by ``1 / δ`` (cheap, exact).
* ``'layerwise'``: one group per parameter tensor. Any scalar or layerwise
  precision is exact (the accumulators hold every pair of groups).
* ``'diag'``: one group whose weight is the per-parameter prior variance at ``fit``.
  Only that precision (or a positive multiple of it given as the same per-parameter
  vector) is exact afterwards; any other needs a new pass over the data, and the
  posterior says so instead of answering with the old one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...backends import JacobianBackend
from ...kernels import n_jacobian_columns

__all__ = [
    "PriorGroups",
    "check_prior_precision",
    "check_sigma_noise",
    "layer_sizes",
]

STRUCTURES = ("scalar", "layerwise", "diag")


def check_prior_precision(
    value: float | torch.Tensor,
    n_layers: int,
    n_params: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Validate a prior precision as laplace-torch's setter does; keep its graph.

    Parameters
    ----------
    value : float or torch.Tensor
        Scalar, ``()``, ``(1,)``, ``(n_layers,)`` or ``(n_params,)``; positive.
    n_layers : int
        Number of parameter tensors.
    n_params : int
        Number of parameters ``P``.
    dtype, device
        Of the result.

    Returns
    -------
    torch.Tensor
        One-dimensional, differentiable if ``value`` is.

    Raises
    ------
    ValueError
        For another shape or type, or a non-positive entry.

    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        prec = torch.tensor([float(value)], dtype=dtype, device=device)
    elif isinstance(value, torch.Tensor):
        if value.ndim > 1:
            raise ValueError(
                "prior_precision must be a scalar or a one-dimensional tensor."
            )
        prec = value.reshape(-1).to(dtype=dtype, device=device)
        if prec.numel() not in (1, n_layers, n_params):
            raise ValueError(
                f"prior_precision has {prec.numel()} entries; expected 1, "
                f"{n_layers} (one per parameter tensor) or {n_params} (one per "
                "parameter)."
            )
    else:
        raise ValueError(
            "prior_precision must be a float or a torch.Tensor (at most 1-D); got "
            f"{type(value).__name__}."
        )
    if bool((prec.detach() <= 0).any()) or not bool(prec.detach().isfinite().all()):
        raise ValueError("prior_precision must be positive and finite.")
    return prec


def check_sigma_noise(
    value: float | torch.Tensor,
    likelihood: str,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Validate an observation noise as laplace-torch's setter does.

    Parameters
    ----------
    value : float or torch.Tensor
        Positive scalar, ``()`` or ``(1,)``.
    likelihood : {'regression', 'classification'}
        Classification only admits ``1``.
    dtype, device
        Of the result.

    Returns
    -------
    torch.Tensor
        ``()``, differentiable if ``value`` is.

    Raises
    ------
    ValueError
        For another shape or type, a non-positive value, or ``σ ≠ 1`` for
        classification.

    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        sigma = torch.tensor(float(value), dtype=dtype, device=device)
    elif isinstance(value, torch.Tensor) and value.numel() == 1 and value.ndim <= 1:
        sigma = value.reshape(()).to(dtype=dtype, device=device)
    else:
        raise ValueError(
            "sigma_noise must be a float or a one-element tensor (homoscedastic)."
        )
    if not bool(sigma.detach() > 0) or not bool(sigma.detach().isfinite()):
        raise ValueError(f"sigma_noise must be positive and finite, got {value}.")
    if likelihood == "classification" and float(sigma) != 1.0:
        raise ValueError("sigma_noise != 1 only available for regression.")
    return sigma


@dataclass(frozen=True)
class PriorGroups:
    """Contiguous parameter groups with a fixed per-parameter weight.

    Attributes
    ----------
    structure : {'scalar', 'layerwise', 'diag'}
        Which prior precisions stay exact after ``fit``.
    bounds : tuple of (int, int)
        ``[start, stop)`` of each group in the parameter vector.
    weight : torch.Tensor
        ``(P,)`` fixed prior-variance weight (ones, or ``Σ₀`` at fit for 'diag').
    n_layers : int
        Number of parameter tensors.

    """

    structure: str
    bounds: tuple[tuple[int, int], ...]
    weight: torch.Tensor
    n_layers: int

    @staticmethod
    def build(
        structure: str, prior_precision: torch.Tensor, layer_sizes: list[int]
    ) -> PriorGroups:
        """Groups for ``structure`` (``prior_precision`` is the one-dim tensor)."""
        P, n_layers = sum(layer_sizes), len(layer_sizes)
        ones = torch.ones(P, dtype=torch.float64, device=prior_precision.device)
        if structure == "scalar":
            return PriorGroups(structure, ((0, P),), ones, n_layers)
        if structure == "layerwise":
            stops = torch.tensor(layer_sizes).cumsum(0).tolist()
            starts = [0, *stops[:-1]]
            return PriorGroups(structure, tuple(zip(starts, stops)), ones, n_layers)
        var = expand_precision(prior_precision.detach(), layer_sizes).reciprocal()
        return PriorGroups("diag", ((0, P),), var.to(torch.float64), n_layers)

    def group_variances(
        self, prior_precision: torch.Tensor, layer_sizes: list[int]
    ) -> torch.Tensor:
        """Per-group prior variance scales ``(G,)``, differentiable.

        Returns
        -------
        torch.Tensor
            ``(G,)`` float64.

        Raises
        ------
        ValueError
            If ``prior_precision`` is not representable by these groups.

        """
        prec = prior_precision.to(torch.float64)
        n = prec.numel()
        if self.structure == "diag":
            fitted = self.weight.reciprocal()
            full = expand_precision(prec.detach(), layer_sizes).to(fitted)
            if not torch.allclose(full, fitted, rtol=1e-12, atol=0):
                raise ValueError(
                    "The posterior was fitted with a per-parameter prior precision; "
                    "another value needs a new pass over the data: call "
                    "fit(train_loader) again after setting prior_precision."
                )
            if prec.requires_grad:
                raise ValueError(
                    "The evidence is not differentiable in a per-parameter prior "
                    "precision (that needs the P x P GGN); use prior_structure="
                    "'scalar' or 'layerwise'."
                )
            return torch.ones(1, dtype=torch.float64, device=prec.device)
        if n == 1:
            return prec.reciprocal().expand(len(self.bounds))
        if self.structure == "layerwise" and n == self.n_layers:
            return prec.reciprocal()
        raise ValueError(
            f"The posterior was fitted with prior_structure={self.structure!r}; a "
            f"prior precision with {n} entries needs "
            + (
                "prior_structure='layerwise' at construction (then fit)."
                if n == self.n_layers
                else "a new pass over the data: call fit(train_loader) again."
            )
        )


def expand_precision(prec: torch.Tensor, layer_sizes: list[int]) -> torch.Tensor:
    """Per-parameter ``(P,)`` precision from a scalar, layerwise or diag one."""
    P = sum(layer_sizes)
    if prec.numel() == 1:
        return prec.reshape(1).expand(P)
    if prec.numel() == P:
        return prec.reshape(P)
    sizes = torch.tensor(layer_sizes, device=prec.device)
    return torch.repeat_interleave(prec.reshape(-1), sizes)


def infer_structure(
    structure: str | None, prior_precision: torch.Tensor, n_layers: int
) -> str:
    """``structure`` checked, or inferred from the precision's length."""
    if structure is not None:
        if structure not in STRUCTURES:
            raise ValueError(
                f"prior_structure must be one of {STRUCTURES} or None, got "
                f"{structure!r}."
            )
        if structure == "scalar" and prior_precision.numel() != 1:
            raise ValueError(
                "prior_structure='scalar' needs a scalar prior_precision; use "
                "'layerwise' or 'diag'."
            )
        return structure
    n = prior_precision.numel()
    if n == 1:
        return "scalar"
    return "layerwise" if n == n_layers else "diag"


def layer_sizes(backend: JacobianBackend) -> list[int]:
    """Parameters per parameter tensor, or ``[P]`` when the columns are a subset."""
    P = n_jacobian_columns(backend)
    sizes = [p.numel() for p in backend.params]
    return sizes if sum(sizes) == P else [P]
