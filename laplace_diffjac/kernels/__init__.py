"""Kernels of a trained network: the prior-scaled GGN/NTK and likelihood Hessians.

``ntk``/``ntk_diag`` build ``J(x1) Σ₀ J(x2)ᵀ`` in laplace-torch's ``(B1, B2, C, C)``
layout from any backend's graph-connected Jacobians, or without forming ``J``
through ``structured_ntk`` for chains of Linear layers and elementwise
activations. ``output_hessians`` gives the GGN likelihood Hessians ``Λₙ``,
``jacobians`` a backend's (last-layer aware) Jacobians, ``jittered_cholesky`` and
``explained_trace`` the factorisations of a Gram. The feature Grams the location
optimiser uses are internal (``_structured``, ``_cross_gram``, ``_symmetric_gram``).
"""

from ._cholesky import explained_trace, jittered_cholesky
from ._likelihood_hessians import output_hessians
from ._ntk import PriorPrecision, jacobians, n_jacobian_columns, ntk, ntk_diag
from ._structured import structured_ntk, supports_structured_ntk

__all__ = [
    "PriorPrecision",
    "explained_trace",
    "jacobians",
    "jittered_cholesky",
    "n_jacobian_columns",
    "ntk",
    "ntk_diag",
    "output_hessians",
    "structured_ntk",
    "supports_structured_ntk",
]
