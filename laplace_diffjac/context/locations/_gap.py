"""The likelihood-weighted Nyström gap, the objective of the location optimiser.

For locations ``Z`` the objective is the Titsias (2009) trace term with the
prior-scaled GGN/NTK kernel ``k`` and the GGN likelihood Hessians ``Λₙ``::

    G(Z) = Σₙ tr(Λₙ (k(xₙ, xₙ) − k(xₙ, Z) K_ZZ⁻¹ k(Z, xₙ)))

It is the part of the training data's curvature that the Nyström approximation
through ``Z`` misses (zero when ``Z`` explains every training point), so it is the
natural loss for choosing the context points of a subset-of-data or DTC
linearised-Laplace posterior. Every summand is non-negative and it is estimated
without bias on minibatches (``N / b`` times the batch sum). The Grams come from
per-layer features where the model allows (never forming ``J``) or from
Jacobians (:mod:`._routes`); they and the Cholesky factor are float64.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...backends import JacobianBackend
from ...data import check_finite, check_fits_model, check_like_model
from ...errors import InvalidInputError
from ...kernels import PriorPrecision, explained_trace
from ._routes import JacobianRoute, Pieces, Route, make_route

__all__ = ["batch_gap", "nystrom_gap", "pieces_trace"]

_F64 = torch.float64


def pieces_trace(route: Route, pieces: Pieces, hessians: torch.Tensor) -> torch.Tensor:
    """``tr(Λₙ k(xₙ, xₙ))`` per input ``(b,)``, float64 (independent of ``Z``)."""
    return torch.einsum("bce,bce->b", hessians.to(_F64), route.diag(pieces))


def batch_gap(
    route: Route,
    z_pieces: Pieces,
    x_pieces: Iterable[Pieces],
    hessians: torch.Tensor,
    trace_nn: torch.Tensor,
    jitter: float,
) -> torch.Tensor:
    """Nyström gap of a batch from both sides' pieces (unscaled sum over the batch).

    Parameters
    ----------
    route : FactorRoute or JacobianRoute
        How pieces are contracted.
    z_pieces : NTKFeatures or torch.Tensor
        The locations' pieces (with graph for a gradient in ``Z``).
    x_pieces : iterable of NTKFeatures or torch.Tensor
        The batch's pieces, in consecutive chunks.
    hessians : torch.Tensor
        ``Λₙ`` of the batch ``(b, C, C)``.
    trace_nn : torch.Tensor
        ``tr(Λₙ k(xₙ, xₙ))`` of the batch ``(b,)``.
    jitter : float
        Relative jitter of ``K_ZZ``.

    Returns
    -------
    torch.Tensor
        Scalar, float64.

    """
    K_zz = route.self_gram(z_pieces)
    K_zx = torch.cat([route.cross(z_pieces, p) for p in x_pieces], dim=1)
    return trace_nn.sum() - explained_trace(K_zz, K_zx, hessians.to(_F64), jitter)


def nystrom_gap(
    backend: JacobianBackend,
    x: torch.Tensor,
    locations: torch.Tensor,
    hessians: torch.Tensor,
    prior_precision: PriorPrecision = 1.0,
    n_data: int | None = None,
    jitter: float = 1e-6,
    chunk_size: int = 256,
    x_jacobians: torch.Tensor | None = None,
    structured: bool | None = None,
) -> torch.Tensor:
    """Likelihood-weighted Nyström gap of a batch, differentiable w.r.t. ``Z``.

    ``Σₙ tr(Λₙ (k(xₙ, xₙ) − k(xₙ, Z) K_ZZ⁻¹ k(Z, xₙ)))``, optionally scaled by
    ``N / b``. The training side is detached (the result is differentiable, once,
    with respect to ``Z`` and, through ``Z``'s side of the kernel, the
    parameters).

    Parameters
    ----------
    backend : JacobianBackend
        Jacobian backend (see :func:`laplace_diffjac.kernels.ntk`).
    x : torch.Tensor
        Training inputs ``(b, *input_shape)``.
    locations : torch.Tensor
        ``Z``, ``(M, *input_shape)``, the model's dtype and device; may require grad.
    hessians : torch.Tensor
        ``Λₙ`` of the batch, ``(b, C, C)``
        (:func:`laplace_diffjac.kernels.output_hessians`).
    prior_precision : float or torch.Tensor, default=1.0
        Scalar or per-parameter prior precision.
    n_data : int, optional
        Size ``N`` of the whole data set: the batch sum is scaled by ``N / b``
        (an unbiased estimate for a uniformly drawn batch). ``None``: no scaling.
    jitter : float, default=1e-6
        Added to ``K_ZZ``'s diagonal, relative to its mean diagonal entry.
    chunk_size : int, default=256
        Inputs of ``x`` whose pieces (Jacobians or features) exist at once.
    x_jacobians : torch.Tensor, optional
        The Jacobians ``(b, C, P)`` of ``x`` if already known; used by the
        Jacobian route only (the structured route never needs them).
    structured : bool, optional
        ``None``: the structured Gram where it applies, else Jacobians;
        ``True``: require the structured route; ``False``: Jacobians.

    Returns
    -------
    torch.Tensor
        Scalar, float64.

    Raises
    ------
    InvalidInputError
        For non-finite ``x`` or ``locations``, ``locations`` whose feature shape,
        dtype or device does not fit ``x`` and the model, or ``hessians`` of the
        wrong shape.
    ValueError
        If ``structured=True`` but the structured route does not apply, or the
        prior precision or jitter is invalid.

    """
    _check_gap_inputs(backend, x, locations, hessians, chunk_size)
    route = make_route(backend, prior_precision, structured, locations.device)
    z_pieces = route.pieces(locations, graph=True)
    given = x_jacobians if isinstance(route, JacobianRoute) else None
    x_chunks, traces = [], []
    for i, (xc, lam) in enumerate(
        zip(torch.split(x, chunk_size), torch.split(hessians, chunk_size))
    ):
        if given is None:
            p = route.pieces(xc, graph=False)
        else:
            p = given[i * chunk_size : i * chunk_size + len(xc)].detach().to(_F64)
        traces.append(pieces_trace(route, p, lam))
        x_chunks.append(p)
    gap = batch_gap(route, z_pieces, x_chunks, hessians, torch.cat(traces), jitter)
    return gap * (n_data / x.shape[0]) if n_data is not None else gap


def _check_gap_inputs(
    backend: JacobianBackend,
    x: torch.Tensor,
    locations: torch.Tensor,
    hessians: torch.Tensor,
    chunk_size: int,
) -> None:
    if chunk_size < 1:
        raise InvalidInputError(f"chunk_size must be >= 1, got {chunk_size}.")
    check_finite(x, "x")
    check_finite(locations, "locations")
    if locations.dim() < 1 or locations.shape[0] < 1:
        raise InvalidInputError("locations must be (M, *input_shape) with M >= 1.")
    if locations.shape[1:] != x.shape[1:]:
        raise InvalidInputError(
            f"locations have feature shape {tuple(locations.shape[1:])} but x has "
            f"{tuple(x.shape[1:])}; pass locations in the inputs' shape."
        )
    check_like_model(locations, "locations", backend.model)
    check_like_model(x, "x", backend.model)
    if hessians.dim() != 3 or hessians.shape[0] != x.shape[0]:
        raise InvalidInputError(
            f"hessians must be (b, C, C) with b = {x.shape[0]} inputs, got "
            f"{tuple(hessians.shape)}; use laplace_diffjac.kernels.output_hessians."
        )
    check_fits_model(locations, "locations", backend.model)
