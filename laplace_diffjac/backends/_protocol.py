"""What the kernels and the context code need from a backend, as a ``Protocol``."""

from __future__ import annotations

from typing import Optional, Protocol, Union, runtime_checkable

import torch
from torch import nn

from ._backpack import DiffBackPackGGN

__all__ = ["BackendSpec", "JacobianBackend", "as_backend"]


@runtime_checkable
class JacobianBackend(Protocol):
    """A laplace-torch curvature backend whose Jacobians stay graph-connected.

    ``DiffBackPackGGN``, ``DiffBackPackEF`` and ``DiffFuncGGN`` are such backends;
    laplace-torch's own backends have the same methods but detach (or, for
    BackPACK, write into ``.grad``) when ``enable_backprop=True``.

    Attributes
    ----------
    model : torch.nn.Module
        The network (for last-layer backends laplace-torch's feature extractor).
    params : list of torch.nn.Parameter
        The parameters the Jacobians are taken with respect to, in order.
    last_layer : bool
        Whether ``last_layer_jacobians`` is the Jacobian to use.
    subnetwork_indices : torch.Tensor or None
        Indices of the parameters kept (subnetwork Laplace), or ``None``.

    """

    model: nn.Module
    params: list[nn.Parameter]
    last_layer: bool
    subnetwork_indices: Optional[torch.Tensor]

    def jacobians(
        self, x: torch.Tensor, enable_backprop: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return Jacobians ``(B, C, P)`` and outputs ``(B, C)``."""
        ...  # pragma: no cover

    def last_layer_jacobians(
        self, x: torch.Tensor, enable_backprop: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return last-layer Jacobians ``(B, C, P_last)`` and outputs ``(B, C)``."""
        ...  # pragma: no cover


#: A backend instance, a backend class, or ``None`` for ``DiffBackPackGGN``.
BackendSpec = Union[JacobianBackend, type, None]


def as_backend(
    model: nn.Module, likelihood: str, backend: BackendSpec = None
) -> JacobianBackend:
    """Return a backend instance: the one given, one built from a class, or ours.

    Parameters
    ----------
    model : torch.nn.Module
        The trained network.
    likelihood : {'regression', 'classification'}
        The likelihood.
    backend : backend instance, backend class or None, default=None
        ``None`` means ``DiffBackPackGGN``; a class is instantiated with
        ``(model, likelihood)``; an instance is returned as it is.

    Returns
    -------
    JacobianBackend
        A backend with ``jacobians(x, enable_backprop)``.

    """
    if backend is None:
        backend = DiffBackPackGGN
    if isinstance(backend, type):
        return backend(model, likelihood)
    return backend
