"""Curvature backends for laplace-torch: graph-connected, free of side effects."""

# First: laplace-torch imported without its dependency's import-time warning.
from . import _laplace_import  # noqa: F401
from ._backpack import DiffBackPackEF, DiffBackPackGGN
from ._functorch import DiffFuncGGN
from ._protocol import BackendSpec, JacobianBackend, as_backend
from ._stand_in import upstream_stand_in

__all__ = [
    "BackendSpec",
    "DiffBackPackEF",
    "DiffBackPackGGN",
    "DiffFuncGGN",
    "JacobianBackend",
    "as_backend",
    "upstream_stand_in",
]
