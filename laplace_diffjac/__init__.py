"""Graph-connected, side-effect-free Jacobian backends for laplace-torch.

Importing the package registers an adapter with laplace-torch so that every
estimator accepts the backends (see :mod:`laplace_diffjac.adapter`).

>>> from laplace_diffjac import DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN
"""

from .adapter import register, unregister
from .backends import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from .context_posterior import ContextPosterior
from .drop_in import patch_laplace
from .errors import InvalidInputError, UnsupportedModuleError
from .functional_locations import (
    LocationFunctionalLaplace,
    functional_laplace_on_locations,
)
from .kernel import ntk, ntk_diag
from .locations import nystrom_gap, optimize_locations

__all__ = [
    "ContextPosterior",
    "DiffBackPackEF",
    "DiffBackPackGGN",
    "DiffFuncGGN",
    "InvalidInputError",
    "LocationFunctionalLaplace",
    "UnsupportedModuleError",
    "functional_laplace_on_locations",
    "ntk",
    "ntk_diag",
    "nystrom_gap",
    "optimize_locations",
    "patch_laplace",
    "register",
    "unregister",
]
__version__ = "0.1.0"

register()
