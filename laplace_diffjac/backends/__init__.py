"""Curvature backends for laplace-torch: graph-connected, free of side effects."""

from ._backpack import DiffBackPackEF, DiffBackPackGGN
from ._functorch import DiffFuncGGN

__all__ = ["DiffBackPackEF", "DiffBackPackGGN", "DiffFuncGGN"]
