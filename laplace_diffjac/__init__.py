"""Graph-connected, side-effect-free Jacobian backends for laplace-torch.

Importing the package registers an adapter with laplace-torch so that every
estimator accepts the backends (see :mod:`laplace_diffjac.laplace_integration`).

>>> from laplace_diffjac import DiffBackPackGGN, DiffBackPackEF, DiffFuncGGN

The subpackages are the layers, each importing only those above it in this list:

* :mod:`laplace_diffjac.jacobians` — the Jacobian engine (no laplace-torch);
* :mod:`laplace_diffjac.backends` — laplace-torch curvature backends on the engine;
* :mod:`laplace_diffjac.kernels` — the NTK and likelihood Hessians;
* :mod:`laplace_diffjac.data` — the one reading of training data, and the sums
  over a ``torch.distributed`` group;
* :mod:`laplace_diffjac.context` — the location optimiser (``context.locations``)
  and the context posterior (``context.posterior``);
* :mod:`laplace_diffjac.laplace_integration` — registration with laplace-torch
  (its estimators accept our backends, its factory builds our posteriors),
  ``patch_laplace`` and ``LocationFunctionalLaplace``;
* :mod:`laplace_diffjac.examples` — data and training for demos and notebooks.
"""

from .backends import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from .budget import memory_budget, set_memory_budget
from .context import (
    ContextPosterior,
    LocationResult,
    LocationSettings,
    evidence_loss_backward,
    nystrom_gap,
    optimize_locations,
)
from .data import TrainingData
from .errors import InvalidInputError, MemoryBudgetError, UnsupportedModuleError
from .kernels import ntk, ntk_diag
from .laplace_integration import (
    LocationFunctionalLaplace,
    functional_laplace_on_locations,
    patch_laplace,
    register,
    unregister,
)

__all__ = [
    "ContextPosterior",
    "DiffBackPackEF",
    "DiffBackPackGGN",
    "DiffFuncGGN",
    "InvalidInputError",
    "LocationFunctionalLaplace",
    "LocationResult",
    "LocationSettings",
    "MemoryBudgetError",
    "TrainingData",
    "UnsupportedModuleError",
    "evidence_loss_backward",
    "functional_laplace_on_locations",
    "memory_budget",
    "ntk",
    "ntk_diag",
    "nystrom_gap",
    "optimize_locations",
    "patch_laplace",
    "register",
    "set_memory_budget",
    "unregister",
]
__version__ = "0.1.0"

register()
