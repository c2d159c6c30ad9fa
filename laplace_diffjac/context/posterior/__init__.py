"""The context posterior: all ``N`` training points seen through ``M`` locations.

:class:`ContextPosterior` (``_posterior``) keeps sums over the data
(``_statistics``, one pass in ``_data_pass``), its evidence bound
(``_evidence``, one eigendecomposition for every scalar δ and σ in
``_factor_cache``), prior groups (``_hyperparameters``), the predictive's link
functions (``_predictive``) and ``optimize_prior_precision`` (``_tuning``).
:func:`evidence_loss_backward` (``_evidence_gradient``) is the same evidence as a
differentiable objective in the locations and the hyperparameters.
"""

from ._evidence_gradient import evidence_loss_backward
from ._posterior import ContextPosterior

__all__ = ["ContextPosterior", "evidence_loss_backward"]
