"""A batch's Jacobians as the context posterior uses them: per-layer factors or ``J``.

Everything the posterior computes from a batch's Jacobians ``J`` ``(b, C, P)`` is
one of four products: prior-weighted Grams against another batch (``K_Zb``,
``K_ZZ``, ``K_Z*``), the per-input or joint Grams of a batch with itself
(``K_**``), the Jacobian-vector product ``J δ`` (the dual mean) and the GGN
diagonal ``Σ_b diag(J_bᵀ Λ_b J_b)`` (the evidence's trace term).
:class:`FactorBatch` computes them from the engine's per-layer factors and never
forms ``J`` (:mod:`laplace_diffjac.kernels` chooses per layer between the factors
and that layer's own block); :class:`JacobianBatch` holds ``J``, for backends
without factors (``DiffFuncGGN``, last-layer and subnetwork backends) and for
the public methods that take Jacobians. :func:`batch_features` picks the first
whenever the backend hands out factors.

Predictions need only the Grams: where every parameter is a plain ``nn.Linear``'s
and the prior is one scalar, :mod:`._linear_predictions` computes them from the
layers' inputs and output signals instead.

A prior variance is ``()`` (the same for every parameter) or ``(P,)``; ``columns``
restricts a Gram to a prior group's column range (whole parameter tensors).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...backends import JacobianBackend
from ...jacobians._engine import JacobianFactors
from ...jacobians._factor_products import factor_ggn_diagonal, factor_jvp
from ...kernels import factor_route_applies
from ...kernels._engine_pieces import engine_factors
from ...kernels._factor_gram import factor_gram

__all__ = [
    "BatchFeatures",
    "BatchOutputs",
    "FactorBatch",
    "JacobianBatch",
    "batch_features",
    "given_jacobians",
    "grouped_joint_blocks",
    "location_features",
]

Columns = tuple[int, int]

#: Inputs per Gram when joint blocks of ``q`` inputs are computed together.
_JOINT_INPUTS = 64


class BatchOutputs:
    """A batch's network outputs, and its sizes read off them.

    Attributes
    ----------
    f : torch.Tensor
        ``(b, C)`` the network's outputs, in float64.

    """

    f: torch.Tensor

    @property
    def batch(self) -> int:
        """Number ``b`` of inputs."""
        return int(self.f.shape[0])

    @property
    def n_outputs(self) -> int:
        """Number ``C`` of outputs."""
        return int(self.f.shape[1])


class BatchFeatures(BatchOutputs, ABC):
    """A batch's outputs and Jacobians, in float64."""

    @property
    def kind(self) -> type[BatchFeatures]:
        """The class whose products these features compute with (their own)."""
        return type(self)

    @abstractmethod
    def as_jacobians(self) -> BatchFeatures:
        """The same features as Jacobians ``J`` (formed if they are factors).

        Returns
        -------
        BatchFeatures
        """

    @abstractmethod
    def gram(
        self,
        other: BatchFeatures,
        prior_var: torch.Tensor,
        columns: Columns | None = None,
    ) -> torch.Tensor:
        """``J Σ₀ J_otherᵀ`` ``(b C, b_other C)``, rows ``(input, output)``-major.

        Parameters
        ----------
        other : BatchFeatures
            Of the same kind and model.
        prior_var : torch.Tensor
            ``()`` or ``(P,)``.
        columns : tuple of int, optional
            Only the columns ``[start, stop)`` (whole parameter tensors).

        Returns
        -------
        torch.Tensor

        """

    @abstractmethod
    def self_blocks(self, prior_var: torch.Tensor) -> torch.Tensor:
        """``J_b Σ₀ J_bᵀ`` per input, ``(b, C, C)``.

        Returns
        -------
        torch.Tensor

        """

    @abstractmethod
    def jvp(self, vector: torch.Tensor) -> torch.Tensor:
        """``J v`` ``(b, C)`` for ``v`` ``(P,)``.

        Returns
        -------
        torch.Tensor

        """

    @abstractmethod
    def ggn_diagonal(self, lam: torch.Tensor) -> torch.Tensor:
        """``Σ_b diag(J_bᵀ Λ_b J_b)`` ``(P,)`` for ``Λ`` ``(b, C, C)``.

        Returns
        -------
        torch.Tensor

        """

    @abstractmethod
    def detach(self) -> BatchFeatures:
        """The same features, cut from the graph.

        Returns
        -------
        BatchFeatures

        """

    def joint_blocks(self, prior_var: torch.Tensor, q: int) -> torch.Tensor:
        """Joint Grams of consecutive groups of ``q`` inputs, ``(b / q, q C, q C)``.

        Returns
        -------
        torch.Tensor

        """
        if q == 1:
            return self.self_blocks(prior_var)
        return self._joint_blocks(prior_var, q)

    @abstractmethod
    def _joint_blocks(self, prior_var: torch.Tensor, q: int) -> torch.Tensor: ...


class JacobianBatch(BatchFeatures):
    """Features held as the Jacobians ``J`` ``(b, C, P)``.

    Parameters
    ----------
    J : torch.Tensor
        ``(b, C, P)``, cast to float64.
    f : torch.Tensor
        ``(b, C)``, cast to float64.

    """

    def __init__(self, J: torch.Tensor, f: torch.Tensor) -> None:
        self.J = J.to(torch.float64)
        self.f = f.to(torch.float64).reshape(J.shape[0], J.shape[1])

    def _weighted(self, prior_var: torch.Tensor, columns: Columns | None) -> tuple:
        J = self.J.reshape(-1, self.J.shape[-1])
        var = prior_var.to(J)
        if columns is not None:
            a, b = columns
            J = J[:, a:b]
            var = var if var.dim() == 0 else var[a:b]
        return J, var

    def gram(
        self,
        other: BatchFeatures,
        prior_var: torch.Tensor,
        columns: Columns | None = None,
    ) -> torch.Tensor:
        """See :meth:`BatchFeatures.gram`."""
        assert isinstance(other, JacobianBatch)
        J1, var = self._weighted(prior_var, columns)
        J2, _ = other._weighted(prior_var, columns)
        return (J1 * var) @ J2.T

    def self_blocks(self, prior_var: torch.Tensor) -> torch.Tensor:
        """See :meth:`BatchFeatures.self_blocks`."""
        return torch.einsum("bcp,bep->bce", self.J * prior_var.to(self.J), self.J)

    def _joint_blocks(self, prior_var: torch.Tensor, q: int) -> torch.Tensor:
        J = self.J.reshape(-1, q * self.n_outputs, self.J.shape[-1])
        return (J * prior_var.to(J)) @ J.mT

    def jvp(self, vector: torch.Tensor) -> torch.Tensor:
        """See :meth:`BatchFeatures.jvp`."""
        return self.J @ vector.to(self.J)

    def ggn_diagonal(self, lam: torch.Tensor) -> torch.Tensor:
        """See :meth:`BatchFeatures.ggn_diagonal`."""
        return (self.J * torch.einsum("bce,bep->bcp", lam, self.J)).sum((0, 1))

    def detach(self) -> JacobianBatch:
        """See :meth:`BatchFeatures.detach`."""
        return JacobianBatch(self.J.detach(), self.f.detach())

    def as_jacobians(self) -> JacobianBatch:
        """See :meth:`BatchFeatures.as_jacobians` (itself)."""
        return self


class FactorBatch(BatchFeatures):
    """Features held as the engine's per-layer factors; ``J`` is never formed.

    Parameters
    ----------
    parts : JacobianFactors
        The factors (cast to float64).
    params : sequence of torch.Tensor
        The backend's parameters, in the Jacobian's column order.

    """

    def __init__(self, parts: JacobianFactors, params: Sequence[torch.Tensor]) -> None:
        self.parts = parts.to(torch.float64)
        self.params = list(params)
        self.f = self.parts.f.reshape(parts.batch, parts.n_rows)
        self._starts = []
        start = 0
        for p in self.params:
            self._starts.append(start)
            start += p.numel()

    def _selected(
        self, prior_var: torch.Tensor, columns: Columns | None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The parameters inside ``columns`` and their prior variance."""
        var = prior_var.to(torch.float64)
        if columns is None:
            return self.params, var
        a, b = columns
        chosen = [
            p
            for p, s in zip(self.params, self._starts)
            if s >= a and s + p.numel() <= b
        ]
        return chosen, (var if var.dim() == 0 else var[a:b])

    def gram(
        self,
        other: BatchFeatures,
        prior_var: torch.Tensor,
        columns: Columns | None = None,
    ) -> torch.Tensor:
        """See :meth:`BatchFeatures.gram`."""
        assert isinstance(other, FactorBatch)
        params, var = self._selected(prior_var, columns)
        K = factor_gram(self.parts, other.parts, params, var)  # (b1, b2, C, C)
        return K.permute(0, 2, 1, 3).reshape(
            self.batch * self.n_outputs, other.batch * other.n_outputs
        )

    def self_blocks(self, prior_var: torch.Tensor) -> torch.Tensor:
        """See :meth:`BatchFeatures.self_blocks`."""
        return factor_gram(self.parts, None, self.params, prior_var.to(torch.float64))

    def _joint_blocks(self, prior_var: torch.Tensor, q: int) -> torch.Tensor:
        def gram(start: int, stop: int) -> torch.Tensor:
            part = FactorBatch(self.parts[slice(start, stop)], self.params)
            return part.gram(part, prior_var)

        return grouped_joint_blocks(self.batch, q, self.n_outputs, gram, self.f)

    def jvp(self, vector: torch.Tensor) -> torch.Tensor:
        """See :meth:`BatchFeatures.jvp`."""
        return factor_jvp(self.parts, self.params, vector.to(torch.float64))

    def ggn_diagonal(self, lam: torch.Tensor) -> torch.Tensor:
        """See :meth:`BatchFeatures.ggn_diagonal`."""
        return factor_ggn_diagonal(self.parts, self.params, lam.to(torch.float64))

    def detach(self) -> FactorBatch:
        """See :meth:`BatchFeatures.detach`."""
        return FactorBatch(self.parts.detach(), self.params)

    def as_jacobians(self) -> JacobianBatch:
        """See :meth:`BatchFeatures.as_jacobians`: ``J`` assembled, detached."""
        return JacobianBatch(
            self.parts.assembled(self.params).detach(), self.f.detach()
        )


def batch_features(
    backend: JacobianBackend, x: Any, enable_backprop: bool, structured: bool = True
) -> BatchFeatures:
    """The features of ``x``: the engine's factors where they apply, else ``J``.

    Parameters
    ----------
    backend : JacobianBackend
        The posterior's (compute) backend.
    x : torch.Tensor
        ``(b, *input_shape)`` in the backend model's dtype and device.
    enable_backprop : bool
        Keep the graph to ``x`` (and the parameters).
    structured : bool, default=True
        ``False`` forms the Jacobians even where factors are available.

    Returns
    -------
    BatchFeatures

    """
    if structured and factor_route_applies(backend):
        parts = engine_factors(backend, x, enable_backprop)
        return FactorBatch(parts, list(backend.params))
    if getattr(backend, "last_layer", False):
        Js, f = backend.last_layer_jacobians(x, enable_backprop=enable_backprop)
    else:
        Js, f = backend.jacobians(x, enable_backprop=enable_backprop)
    return JacobianBatch(Js, f)


def location_features(
    backend: JacobianBackend, locations: torch.Tensor, structured: bool
) -> BatchFeatures:
    """The locations' features, computed without a graph and detached.

    Returns
    -------
    BatchFeatures

    """
    with torch.no_grad():
        features = batch_features(backend, locations, False, structured)
    return features.detach()


def given_jacobians(Js: torch.Tensor) -> JacobianBatch:
    """Jacobians ``(B*, C, P)`` that a caller passed, as features (no outputs).

    Returns
    -------
    JacobianBatch

    """
    return JacobianBatch(Js, Js.new_zeros(Js.shape[:2]))


def grouped_joint_blocks(
    n_inputs: int,
    q: int,
    n_outputs: int,
    gram: Callable[[int, int], torch.Tensor],
    like: torch.Tensor,
) -> torch.Tensor:
    """Joint Grams of consecutive groups of ``q`` inputs, ``(n_inputs / q, q C, q C)``.

    ``k`` groups at a time: one Gram of ``k q`` inputs, its ``k`` diagonal blocks
    kept (``k`` times the work of the blocks alone, in a few large contractions
    instead of one small one per group: BoTorch asks for hundreds).

    Parameters
    ----------
    n_inputs, q, n_outputs : int
        ``b``, ``q`` and ``C``.
    gram : callable
        ``gram(start, stop)``: the Gram ``(m C, m C)`` of inputs ``[start,
        stop)``, input-major (``m = stop − start``).
    like : torch.Tensor
        Gives the dtype and device of an empty result.

    Returns
    -------
    torch.Tensor

    """
    n, C = n_inputs // q, n_outputs
    k = max(1, _JOINT_INPUTS // q)
    blocks = []
    for start in range(0, n, k):
        m = min(n, start + k) - start
        K = gram(start * q, (start + m) * q).view(m, q * C, m, q * C)
        blocks.append(K.diagonal(dim1=0, dim2=2).permute(2, 0, 1))
    if not blocks:
        return like.new_zeros(0, q * C, q * C)
    return torch.cat(blocks)
