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

# Adapter to laplace-torch (issue 3): accept these backends in every estimator.
from .adapter import register, unregister  # noqa: E402
from .drop_in import patch_laplace  # noqa: E402

__all__ += ["patch_laplace", "register", "unregister"]
register()
