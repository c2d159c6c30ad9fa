"""Kernels of a trained network: the prior-scaled GGN/NTK and likelihood Hessians.

``ntk``/``ntk_diag`` build ``J(x1) Σ₀ J(x2)ᵀ`` in laplace-torch's ``(B1, B2, C, C)``
layout from any backend's graph-connected Jacobians, or without forming ``J``
through ``structured_ntk`` for chains of Linear layers and elementwise
activations. ``output_hessians`` gives the GGN likelihood Hessians ``Λₙ``.
"""

from ._activations import ACTIVATIONS
from ._cholesky import explained_trace, jittered_cholesky
from ._cross_gram import cross_feature_gram
from ._likelihood_hessians import output_hessians
from ._ntk import (
    PriorPrecision,
    flat_gram,
    gram,
    jacobians,
    n_jacobian_columns,
    ntk,
    ntk_diag,
    prior_variance,
    structured_applies,
)
from ._structured import (
    check_structured,
    structured_features,
    structured_ntk,
    supports_structured_ntk,
)
from ._structured_features import NTKFeatures, feature_diag, feature_gram
from ._symmetric_gram import symmetric_feature_gram

__all__ = [
    "ACTIVATIONS",
    "NTKFeatures",
    "PriorPrecision",
    "check_structured",
    "cross_feature_gram",
    "explained_trace",
    "feature_diag",
    "feature_gram",
    "flat_gram",
    "gram",
    "jacobians",
    "jittered_cholesky",
    "n_jacobian_columns",
    "ntk",
    "ntk_diag",
    "output_hessians",
    "prior_variance",
    "structured_applies",
    "structured_features",
    "structured_ntk",
    "supports_structured_ntk",
    "symmetric_feature_gram",
]
