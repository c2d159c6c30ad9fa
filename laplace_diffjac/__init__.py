"""Graph-connected, side-effect-free Jacobian backends for laplace-torch.

>>> from laplace_diffjac import DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN
"""

from .backends import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from .errors import InvalidInputError, UnsupportedModuleError

__all__ = [
    "DiffBackPackEF",
    "DiffBackPackGGN",
    "DiffFuncGGN",
    "InvalidInputError",
    "UnsupportedModuleError",
]
__version__ = "0.1.0"
