"""The prior-scaled GGN/NTK Gram ``J(x1) Σ₀ J(x2)ᵀ``, chunked and differentiable.

The layout is laplace-torch's ``FunctionalLaplace`` one: ``(B1, B2, C, C)`` with
entry ``[a, b, c, e] = J_c(x1_a) Σ₀ J_e(x2_b)ᵀ`` (einsum ``"acp,p,bep->abce"``).

Two routes compute it:

* the general route asks a backend (any of :mod:`laplace_diffjac.backends`) for
  per-sample Jacobians block by block, so at most ``chunk_size`` Jacobians of each
  input live at once while the Gram is built;
* the structured route never forms ``J``: the Jacobian engine's per-layer
  factors (:mod:`._engine_pieces`), for every model of the BackPACK backends
  (``DiffBackPackGGN``, ``DiffBackPackEF``: classes, residual and shared layers,
  convolutions, norms, embeddings, attention, recurrent layers, dict inputs) and
  for any backend's ``nn.Sequential`` chain of Linear layers and elementwise
  activations. Where every parameter is a Linear layer's and the prior a
  scalar, the factors are regrouped by layer and contracted as features
  (``B1 B2 (width_in + C² width_out)`` per layer); otherwise parameter by
  parameter (:mod:`._factor_gram`), with scalar, per-layer or per-parameter
  priors. It is used automatically when the backend takes all parameters (no
  last-layer or subnetwork restriction) and ``structured`` is not ``False``;
  other ``DiffFuncGGN`` models, last-layer and subnetwork backends use the
  general route.

Both routes are differentiable with respect to ``x1``, ``x2`` and the parameters
whenever gradients are enabled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..backends import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN, JacobianBackend
from ..budget import get_memory_budget
from ..errors import MemoryBudgetError
from ._budgeted import (
    Costs,
    Plan,
    Route,
    batch_of,
    plan_diagonal,
    plan_gram,
    probe,
)
from ._chunked_gram import budgeted_diagonal, budgeted_gram
from ._column_blocks import jacobian_diagonal, jacobian_gram
from ._engine_pieces import (
    EnginePieces,
    engine_pieces,
    factor_route_applies,
    pieces_diag,
    pieces_gram,
)
from ._route_costs import (
    COUNTED_BATCH,
    COUNTING_AVAILABLE,
    StepWork,
    Work,
    device_costs,
    step_work,
)

PriorPrecision = Union[float, torch.Tensor]

__all__ = [
    "flat_gram",
    "gram",
    "jacobians",
    "factor_route_applies",
    "n_jacobian_columns",
    "ntk",
    "ntk_diag",
    "prior_variance",
]


def prior_variance(
    prior_precision: PriorPrecision, n_params: int, like: torch.Tensor
) -> torch.Tensor:
    """Return the prior variance ``Σ₀ = prior_precision⁻¹``, scalar or vector.

    Parameters
    ----------
    prior_precision : float or torch.Tensor
        Scalar, ``(1,)`` or per-parameter ``(P,)``.
    n_params : int
        Number of parameters ``P`` the Jacobians have.
    like : torch.Tensor
        Tensor whose device and dtype the result takes.

    Returns
    -------
    torch.Tensor
        ``()`` for a scalar prior, ``(P,)`` otherwise.

    Raises
    ------
    ValueError
        If the precision is not positive or its length is neither 1 nor ``P``.

    """
    if isinstance(prior_precision, (int, float)):  # no tensor, no check on it
        if not prior_precision > 0:
            raise ValueError("prior_precision must be positive.")
        number = torch.as_tensor(prior_precision, device=like.device, dtype=like.dtype)
        return number.reciprocal()
    prec = torch.as_tensor(prior_precision, device=like.device, dtype=like.dtype)
    if prec.numel() == 1:
        prec = prec.reshape(())
    elif prec.shape != (n_params,):
        raise ValueError(
            f"prior_precision must be a scalar or have {n_params} entries (one per "
            f"parameter); got shape {tuple(prec.shape)}."
        )
    if bool((prec <= 0).any()):
        raise ValueError("prior_precision must be positive.")
    return prec.reciprocal()


def gram(
    J1: torch.Tensor, J2: torch.Tensor, prior_var: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """Contract two Jacobian batches into a kernel block.

    Parameters
    ----------
    J1 : torch.Tensor
        ``(B1, C, P)``.
    J2 : torch.Tensor
        ``(B2, C, P)``.
    prior_var : torch.Tensor or float, default=1.0
        Scalar or ``(P,)`` prior variance.

    Returns
    -------
    torch.Tensor
        ``(B1, B2, C, C)``, ``J1 Σ₀ J2ᵀ``.

    """
    prior_var = torch.as_tensor(prior_var, device=J1.device, dtype=J1.dtype)
    return jacobian_gram(J1, J2, prior_var)


def flat_gram(
    J1: torch.Tensor, J2: torch.Tensor, prior_var: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """The kernel block of :func:`gram` as a matrix, rows and columns input-major.

    Parameters
    ----------
    J1 : torch.Tensor
        ``(B1, C, P)``.
    J2 : torch.Tensor
        ``(B2, C, P)``.
    prior_var : torch.Tensor or float, default=1.0
        Scalar or ``(P,)`` prior variance.

    Returns
    -------
    torch.Tensor
        ``(B1 C, B2 C)`` with entry ``[a C + c, b C + e] = J_c(x1_a) Σ₀ J_e(x2_b)ᵀ``,
        the order of laplace-torch's ``K_MM``.

    """
    B1, C = J1.shape[:2]
    B2 = J2.shape[0]
    return gram(J1, J2, prior_var).permute(0, 2, 1, 3).reshape(B1 * C, B2 * C)


def _chunks(x: Any, size: int) -> list[Any]:
    """Split a batch (a tensor, or a mapping of tensors sharing dim 0) into chunks."""
    if isinstance(x, Mapping):
        n = len(next(iter(x.values())))
        starts = range(0, n, size) if n else [0]
        return [
            type(x)({k: v[s : s + size] for k, v in x.items()})  # type: ignore[call-arg]
            for s in starts
        ]
    return list(torch.split(x, size, dim=0)) if x.shape[0] else [x]


def jacobians(
    backend: JacobianBackend, x: torch.Tensor, enable_backprop: bool | None = None
) -> torch.Tensor:
    """Per-sample Jacobians of a backend, last-layer aware.

    Parameters
    ----------
    backend : laplace.curvature.CurvatureInterface
        Backend; with ``last_layer=True`` its ``last_layer_jacobians`` is used.
    x : torch.Tensor
        ``(B, *input_shape)``.
    enable_backprop : bool, optional
        Keep the graph; default: whether gradients are enabled.

    Returns
    -------
    torch.Tensor
        ``(B, C, P)``.

    """
    if enable_backprop is None:
        enable_backprop = torch.is_grad_enabled()
    if getattr(backend, "last_layer", False):
        Js, _ = backend.last_layer_jacobians(x, enable_backprop=enable_backprop)
    else:
        Js, _ = backend.jacobians(x, enable_backprop=enable_backprop)
    return Js


def _jacobian_fn(backend: JacobianBackend) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: jacobians(backend, x)


def _pieces_of(
    backend: JacobianBackend, prior_var: torch.Tensor | None, dtype: torch.dtype | None
) -> Callable[[Any], EnginePieces]:
    """A batch's engine pieces in ``dtype``, with a graph while gradients are on.

    Linear layers' factors are regrouped into features for a scalar
    ``prior_var``; ``None`` keeps the factors.

    Returns
    -------
    callable
        ``x ->`` its pieces.
    """
    regroup = prior_var is not None and prior_var.dim() == 0

    def pieces(x: Any) -> EnginePieces:
        graph = torch.is_grad_enabled()
        return engine_pieces(backend, x, graph, regroup, dtype)

    return pieces


def ntk(
    backend: JacobianBackend,
    x1: torch.Tensor,
    x2: torch.Tensor | None = None,
    prior_precision: PriorPrecision = 1.0,
    chunk_size: int = 256,
    structured: bool | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Prior-scaled GGN/NTK Gram ``J(x1) Σ₀ J(x2)ᵀ`` in laplace-torch's layout.

    Parameters
    ----------
    backend : laplace.curvature.CurvatureInterface
        A backend whose ``jacobians(x, enable_backprop)`` returns graph-connected
        ``(batch, C, P)`` Jacobians, e.g. ``DiffBackPackGGN``, ``DiffBackPackEF`` or
        ``DiffFuncGGN``. Last-layer backends use ``last_layer_jacobians``; a
        subnetwork backend's Jacobians are already restricted.
    x1 : torch.Tensor
        ``(B1, *input_shape)``.
    x2 : torch.Tensor, optional
        ``(B2, *input_shape)``; ``None`` (or ``x1`` itself, the same tensor) means
        ``x1``, whose Jacobians or pieces are then computed once.
    prior_precision : float or torch.Tensor, default=1.0
        Scalar or per-parameter ``(P,)`` prior precision; ``Σ₀`` is its inverse.
    chunk_size : int, default=256
        At most this many inputs of ``x1`` and of ``x2`` have their Jacobians
        (or per-layer factors) materialised at once. The memory budget
        (:mod:`laplace_diffjac.budget`) may take fewer: when the features of all
        inputs, with the graph a gradient needs, do not fit it, the Gram is built
        in row chunks that do, and its backward pass recomputes them chunk by
        chunk (differentiable once).
    structured : bool, optional
        ``None`` uses :func:`laplace_diffjac.kernels.structured_ntk` when it
        applies and falls back otherwise; ``False`` always uses Jacobians; ``True``
        requires the structured route.
    dtype : torch.dtype, optional
        Contract (and return) in this dtype, e.g. ``torch.float64`` for accurate
        accumulation from float32 Jacobians. Default: the Jacobians' dtype.

    Returns
    -------
    torch.Tensor
        ``(B1, B2, C, C)``; differentiable with respect to ``x1``, ``x2`` and the
        parameters while gradients are enabled.

    Raises
    ------
    ValueError
        If ``structured=True`` but the structured route does not apply, or the
        prior precision has the wrong size.
    MemoryBudgetError
        If one input per chunk does not fit the memory budget, before any chunk
        is computed.

    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be positive.")
    symmetric = x2 is None or x2 is x1  # one tensor: its pieces once
    x2 = x1 if x2 is None else x2
    n_params = n_jacobian_columns(backend)
    first = _first_param(backend)
    device = first.device
    prior_var = prior_variance(
        prior_precision,
        n_params,
        torch.empty((), device=device, dtype=dtype or first.dtype),
    )
    use_factors = structured is not False and factor_route_applies(backend)
    if structured and not use_factors:
        raise ValueError(
            "The structured NTK route does not apply here: it needs DiffBackPackGGN "
            "or DiffBackPackEF over all parameters (not last-layer or subnetwork), "
            "or an nn.Sequential chain of Linear layers and elementwise activations "
            "with a scalar prior. Pass structured=None to fall back to Jacobians."
        )
    grad = _gradient_possible(backend.params, prior_var, x1, x2)
    use_factors, features, plan = _gram_route(
        backend,
        use_factors,
        structured is None,
        x1,
        (batch_of(x1), batch_of(x2)),
        symmetric,
        grad,
        prior_var,
        dtype,
        chunk_size,
    )
    if plan.chunked:
        return budgeted_gram(
            features, plan, x1, None if symmetric else x2, prior_var, grad
        )
    if use_factors:
        return _factor_blocks(backend, x1, x2, symmetric, chunk_size, prior_var, dtype)
    jac = _jacobian_fn(backend)

    def block_from(J1: torch.Tensor, x2c: torch.Tensor, same: bool) -> torch.Tensor:
        J2 = J1 if same else jac(x2c)
        if dtype is not None:
            J1, J2 = J1.to(dtype), J2.to(dtype)
        return gram(J1, J2, prior_var)

    rows = []
    for i, x1c in enumerate(_chunks(x1, chunk_size)):
        J1 = jac(x1c)
        cols = [
            block_from(J1, x2c, symmetric and i == j)
            for j, x2c in enumerate(_chunks(x2, chunk_size))
        ]
        rows.append(_cat(cols, dim=1))
    return _cat(rows, dim=0)


def _gram_route(
    backend: JacobianBackend,
    factors_apply: bool,
    choose: bool,
    x1: Any,
    sizes: tuple[int, int],
    symmetric: bool,
    grad: bool,
    prior_var: torch.Tensor,
    dtype: torch.dtype | None,
    chunk_size: int,
    diagonal: bool = False,
) -> tuple[bool, Route, Plan]:
    """The route of :func:`ntk` or :func:`ntk_diag` and its plan within the budget.

    ``diagonal`` plans :func:`ntk_diag` (``sizes`` then ``(B, B)``). Where the
    factor route applies and ``choose`` (``structured=None``), the cheaper route on
    this device (:func:`_factors_cheaper`); a Jacobian route so chosen that would
    need chunks, or does not fit the budget at all, gives way to the factor route,
    which holds less.

    Returns
    -------
    tuple
        Whether the route is the factor route, the route, and its plan.
    """
    budget = get_memory_budget(prior_var.device)

    def planned(factors: bool) -> tuple[bool, Route, Plan]:
        route = _budget_route(backend, factors, dtype, prior_var=prior_var)
        costs = _costs(backend, route, x1, prior_var, factors, dtype)
        scale = route.backward_scale
        if diagonal:
            plan = plan_diagonal(costs, sizes[0], grad, budget, chunk_size, scale)
        else:
            plan = plan_gram(costs, sizes, symmetric, grad, budget, chunk_size, scale)
        return factors, route, plan

    if not (factors_apply and choose):
        return planned(factors_apply)
    factors = planned(True)
    largest = factors[2].chunk
    if _factors_cheaper(
        backend, x1, sizes, symmetric, grad, prior_var, dtype, budget, diagonal, largest
    ):
        return factors
    try:  # the Jacobian route, chosen by its estimate: whole, or not at all
        chosen = planned(False)
    except MemoryBudgetError:
        return factors
    return factors if chosen[2].chunked else chosen


def ntk_diag(
    backend: JacobianBackend,
    x: torch.Tensor,
    prior_precision: PriorPrecision = 1.0,
    chunk_size: int = 256,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Compute the per-input blocks ``J(xₙ) Σ₀ J(xₙ)ᵀ`` (diagonal of :func:`ntk`).

    Parameters
    ----------
    backend : laplace.curvature.CurvatureInterface
        As for :func:`ntk`.
    x : torch.Tensor
        ``(B, *input_shape)``.
    prior_precision : float or torch.Tensor, default=1.0
        Scalar or per-parameter ``(P,)``.
    chunk_size : int, default=256
        Inputs whose Jacobians are materialised at once; fewer if the memory
        budget asks for it, as for :func:`ntk`.
    dtype : torch.dtype, optional
        Contraction dtype, as for :func:`ntk`.

    Returns
    -------
    torch.Tensor
        ``(B, C, C)``.

    Raises
    ------
    MemoryBudgetError
        If one input does not fit the memory budget, or a gradient may be asked
        for dict inputs that do not fit it in one piece.

    """
    first = _first_param(backend)
    device = first.device
    prior_var = prior_variance(
        prior_precision,
        n_jacobian_columns(backend),
        torch.empty((), device=device, dtype=dtype or first.dtype),
    )
    grad = _gradient_possible(backend.params, prior_var, x)
    use_factors, features, plan = _gram_route(
        backend,
        factor_route_applies(backend),
        True,
        x,
        (batch_of(x), batch_of(x)),
        True,
        grad,
        prior_var,
        dtype,
        chunk_size,
        diagonal=True,
    )
    if plan.chunked:
        return budgeted_diagonal(features, plan, x, prior_var, grad)
    if use_factors:
        pieces = _pieces_of(backend, prior_var, dtype)
        params = list(backend.params)
        parts = [
            pieces_diag(pieces(xc), params, prior_var) for xc in _chunks(x, chunk_size)
        ]
        diag = _cat(parts, dim=0)
        return diag if dtype is None else diag.to(dtype)
    jac = _jacobian_fn(backend)
    out = []
    for xc in _chunks(x, chunk_size):
        J = jac(xc)
        J = J if dtype is None else J.to(dtype)
        out.append(jacobian_diagonal(J, prior_var))
    return _cat(out, dim=0)


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat``, without its copy when there is one tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def _factor_blocks(
    backend: JacobianBackend,
    x1: torch.Tensor,
    x2: torch.Tensor,
    symmetric: bool,
    chunk_size: int,
    prior_var: torch.Tensor,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """:func:`ntk` from the engine's pieces, each chunk's computed once."""
    pieces = _pieces_of(backend, prior_var, dtype)
    params = list(backend.params)
    left = [pieces(c) for c in _chunks(x1, chunk_size)]
    right = left if symmetric else [pieces(c) for c in _chunks(x2, chunk_size)]
    rows = []
    for f1 in left:
        row = _cat([pieces_gram(f1, f2, params, prior_var) for f2 in right], 1)
        rows.append(row if dtype is None else row.to(dtype))
    return _cat(rows, dim=0)


def n_jacobian_columns(backend: JacobianBackend) -> int:
    """Number ``P`` of columns of the backend's Jacobians.

    Parameters
    ----------
    backend : JacobianBackend
        A backend; its ``params`` are already restricted to the trainable (and,
        for last-layer backends, last-layer) parameters.

    Returns
    -------
    int
        ``len(subnetwork_indices)`` for a subnetwork backend, else the number of
        entries of ``backend.params``.

    """
    indices = getattr(backend, "subnetwork_indices", None)
    if indices is not None:
        return int(indices.numel())
    return sum(p.numel() for p in backend.params)


def _first_param(backend: JacobianBackend) -> torch.Tensor:
    """The model's first parameter: its device and dtype are the model's."""
    return next(iter(backend.model.parameters()))


def _budget_route(
    backend: JacobianBackend,
    use_factors: bool,
    dtype: torch.dtype | None,
    contract_dtype: torch.dtype | None = None,
    prior_var: torch.Tensor | None = None,
) -> Route:
    """The features the memory budget chunks: the engine's pieces, or Jacobians.

    The engine's pieces are Linear features for a scalar ``prior_var`` where the
    model's parameters are all Linear layers', else per-layer factors (always
    for ``prior_var=None``, as :func:`.feature_sizes` counts them).
    Features are made in ``dtype`` (the model's for ``None``); a pair widens
    them to ``contract_dtype`` for its own duration when one is given (the
    location optimiser holds its pieces in the model's dtype and contracts them
    in float64).

    Returns
    -------
    Route
        Features, their pair contraction and how to take them apart.
    """
    params = list(backend.params)

    def widened(f: Any) -> Any:
        return f if contract_dtype is None or f is None else f.to(contract_dtype)

    if use_factors:

        def factor_pair(
            f1: EnginePieces, f2: EnginePieces | None, var: torch.Tensor
        ) -> torch.Tensor:
            w1 = widened(f1)
            if f2 is None:
                return pieces_diag(w1, params, var)
            return pieces_gram(w1, w1 if f2 is f1 else widened(f2), params, var)

        return Route(
            features=_pieces_of(backend, prior_var, dtype),
            pair=factor_pair,
            tensors=lambda f: f.float_tensors(),
            rebuild=lambda f, tensors: f.with_tensors(tensors),
            take=lambda f, where: f[where],
            exclude=params,
            params=params,
        )
    jac = _jacobian_fn(backend)

    def jacobians_in(x: torch.Tensor) -> torch.Tensor:
        J = jac(x)
        return J if dtype is None else J.to(dtype)

    def jacobian_pair(
        J1: torch.Tensor, J2: torch.Tensor | None, var: torch.Tensor
    ) -> torch.Tensor:
        w1 = widened(J1)
        if J2 is None:
            return jacobian_diagonal(w1, var)
        return gram(w1, w1 if J2 is J1 else widened(J2), var)

    return Route(
        features=jacobians_in,
        pair=jacobian_pair,
        tensors=lambda J: [J],
        rebuild=lambda J, tensors: tensors[0],
        take=lambda J, where: J[where],
        exclude=list(backend.model.parameters()),
        params=params,
        backward_scale=4.0,
    )


def _gradient_possible(
    params: Iterable[torch.Tensor], prior_var: torch.Tensor, *xs: Any
) -> bool:
    """Whether a gradient of the Gram may be asked for: a graph must be kept."""
    if not torch.is_grad_enabled():
        return False
    tensors: list[torch.Tensor] = [prior_var, *params]
    for x in xs:
        if x is None:
            continue
        tensors.extend(x.values() if isinstance(x, Mapping) else [x])
    return any(t.requires_grad for t in tensors)


#: The attribute under which this package's backends keep their probes' costs.
_COSTS_ATTRIBUTE = "_laplace_diffjac_memory_costs"


def _costs(
    backend: JacobianBackend,
    route: Route,
    x: Any,
    prior_var: torch.Tensor,
    use_factors: bool,
    dtype: torch.dtype | None,
    contract_dtype: torch.dtype | None = None,
) -> Costs:
    """The probe's costs, measured once per input layout on this package's backends.

    What a probe measures depends on the model, the route and the inputs' shape
    and dtype, never on their values, so a backend of this package keeps it (an
    attribute of the backend, never of the model) and later calls skip the probe's
    two small passes. Other backends are probed at every call.

    Returns
    -------
    Costs
        As :func:`._budgeted.probe` measures them.
    """
    if not isinstance(backend, (DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN)):
        return probe(route, x, prior_var)
    key = (use_factors, dtype, contract_dtype, *_layout(x, prior_var))
    return _kept(backend, _COSTS_ATTRIBUTE, key, lambda: probe(route, x, prior_var))


def _layout(x: Any, prior_var: torch.Tensor) -> tuple:
    """What a probe's result depends on: the inputs' and the prior's layouts."""
    items = sorted(x.items()) if isinstance(x, Mapping) else [("", x)]
    layout = tuple((k, tuple(v.shape[1:]), v.dtype, v.device) for k, v in items)
    return layout, (tuple(prior_var.shape), prior_var.dtype)


def _kept(backend: JacobianBackend, attribute: str, key: tuple, make: Callable) -> Any:
    """``make()``, kept under ``key`` in a dict that is an attribute of ``backend``."""
    known: dict = getattr(backend, attribute, None) or {}
    setattr(backend, attribute, known)
    if key not in known:
        known[key] = make()
    return known[key]


#: The attribute under which this package's backends keep their routes' work.
_WORK_ATTRIBUTE = "_laplace_diffjac_step_work"


@dataclass
class _Choice:
    """One call shape's route choice, kept on the backend.

    Attributes
    ----------
    jacobian_bytes : int
        The bytes of the batch's ``J`` (0 until the factor route is counted).
    factors : bool or None
        Whether the factor route is the cheaper; ``None`` until compared (a
        budget too small for ``J`` decides without comparing).
    """

    jacobian_bytes: int = 0
    factors: bool | None = None


def _factors_cheaper(
    backend: JacobianBackend,
    x: Any,
    sizes: tuple[int, int],
    symmetric: bool,
    grad: bool,
    prior_var: torch.Tensor,
    dtype: torch.dtype | None,
    budget: int,
    diagonal: bool = False,
    largest: int = COUNTED_BATCH,
) -> bool:
    """Whether the default of :func:`ntk` or :func:`ntk_diag` takes the factor route.

    ``diagonal`` asks for :func:`ntk_diag` (each input's block with itself). Both
    routes' steps are counted once per input layout (kernels, views, multiply-adds,
    bytes: :mod:`._route_costs`) and their times estimated with the device's
    constants; the factor route is kept on ties. Before the Jacobian route's step is
    counted, its floor (its Gram's ``B1 B2 C² P`` multiply-adds and the bytes of
    ``J``) is compared with the factor route's estimate, so that a wide model never
    forms a Jacobian to be counted. The counts and choices are kept on this
    package's BackPACK backends; other backends (whose factor route is an
    ``nn.Sequential`` chain of Linear layers) keep the factor route. Where four
    Jacobians of the batch (what the Jacobian route's backward pass holds) exceed
    ``budget`` bytes, the factor route is taken without counting; a Jacobian route
    that the plan would chunk gives way to it too (:func:`_gram_route`).

    Returns
    -------
    bool
        ``True`` for the factor route.
    """
    if not COUNTING_AVAILABLE or not isinstance(
        backend, (DiffBackPackGGN, DiffBackPackEF)
    ):
        return True
    counted = max(1, min(sizes[0], largest, COUNTED_BATCH))
    layout = (dtype, grad, diagonal, counted, *_layout(x, prior_var))
    choice = _kept(
        backend, _WORK_ATTRIBUTE, ("choice", *layout, sizes, symmetric), _Choice
    )
    if 4 * choice.jacobian_bytes > budget:  # the Jacobian route's backward: 4 J
        return True
    if choice.factors is not None:
        return choice.factors
    first = _first_param(backend)
    contract = dtype or first.dtype
    costs = device_costs(first.device, contract)

    def work(factors: bool) -> StepWork:
        def count() -> StepWork:
            route = _budget_route(backend, factors, dtype, prior_var=prior_var)
            return step_work(route, x, prior_var, grad, diagonal, counted)

        return _kept(backend, _WORK_ATTRIBUTE, (factors, *layout), count)

    factor_work = work(True)
    n_params, n_out = n_jacobian_columns(backend), factor_work.outputs
    itemsize = torch.empty((), dtype=contract).element_size()
    inputs = sizes[0] if symmetric else sum(sizes)
    choice.jacobian_bytes = jacobian_bytes = inputs * n_out * n_params * itemsize
    if 4 * jacobian_bytes > budget:
        return True
    factor_seconds = costs.seconds(factor_work.at(*sizes, symmetric))
    pairs = sizes[0] if diagonal else sizes[0] * sizes[1]
    floor = Work(0, 0, pairs * n_out**2 * n_params, jacobian_bytes)
    choice.factors = costs.seconds(floor) >= factor_seconds or (
        factor_seconds <= costs.seconds(work(False).at(*sizes, symmetric))
    )
    return choice.factors
