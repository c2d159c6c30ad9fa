"""Curvature backends for laplace-torch: graph-connected, free of side effects."""

from .backpack import DiffBackPackEF, DiffBackPackGGN
from .functorch import DiffFuncGGN

__all__ = ["DiffBackPackEF", "DiffBackPackGGN", "DiffFuncGGN"]
