"""Kernels of a trained network: the prior-scaled GGN/NTK and likelihood Hessians.

``ntk``/``ntk_diag`` build ``J(x1) Σ₀ J(x2)ᵀ`` in laplace-torch's ``(B1, B2, C, C)``
layout without forming ``J`` wherever they can: from the Jacobian engine's
per-layer factors for ``DiffBackPackGGN``/``DiffBackPackEF`` over all parameters
(any module structure the backends take, any prior; ``factor_route_applies``) and
for any backend's ``nn.Sequential`` chain of Linear layers and elementwise
activations (``structured_ntk``), regrouped by layer where every parameter is a
Linear layer's; otherwise (other ``DiffFuncGGN`` models, last-layer and subnetwork
backends, ``structured=False``) from any backend's graph-connected Jacobians.
``output_hessians`` gives the GGN likelihood Hessians ``Λₙ``,
``jacobians`` a backend's (last-layer aware) Jacobians, ``jittered_cholesky`` and
``explained_trace`` the factorisations of a Gram. The feature Grams the location
optimiser uses are internal (``_engine_pieces``, ``_cross_gram``, ``_symmetric_gram``).
"""

from ._cholesky import explained_trace, jittered_cholesky
from ._likelihood_hessians import output_hessians
from ._ntk import (
    PriorPrecision,
    factor_route_applies,
    jacobians,
    n_jacobian_columns,
    ntk,
    ntk_diag,
)
from ._structured import structured_ntk, supports_structured_ntk

__all__ = [
    "PriorPrecision",
    "explained_trace",
    "factor_route_applies",
    "jacobians",
    "jittered_cholesky",
    "n_jacobian_columns",
    "ntk",
    "ntk_diag",
    "output_hessians",
    "structured_ntk",
    "supports_structured_ntk",
]
