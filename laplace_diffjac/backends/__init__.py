"""Curvature backends for laplace-torch whose Jacobians are graph-connected and free
of side effects."""

from .backpack import DiffBackPackEF, DiffBackPackGGN
from .functorch import DiffFuncGGN

__all__ = ["DiffBackPackEF", "DiffBackPackGGN", "DiffFuncGGN"]
