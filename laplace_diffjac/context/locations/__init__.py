"""The location optimiser: move ``M`` locations to where the NTK is informative.

:func:`optimize_locations` (``_optimizer``) takes its options from
:class:`LocationSettings` (``_settings``), initialises the locations
(``_init``: random subset or k-means, from one pass over the data in memory or
streamed: ``_sources``, ``_scan``), and minimises the likelihood-weighted
Nyström gap (``_gap``) on minibatches, through Jacobians or the structured Gram
(``_routes``), with the training side computed once (``_training_cache``) or
streamed (``_streaming``); minibatches and early stopping in ``_minibatches``,
the ranks' learning rate and gradients in ``_sharding``. With
``objective='evidence'`` it ascends the context posterior's evidence instead
(``_evidence_steps``).
"""

from ._gap import nystrom_gap
from ._init import initial_locations, kmeans, random_subset
from ._optimizer import optimize_locations
from ._result import LocationHistory, LocationResult
from ._settings import LocationSettings

__all__ = [
    "LocationHistory",
    "LocationResult",
    "LocationSettings",
    "initial_locations",
    "kmeans",
    "nystrom_gap",
    "optimize_locations",
    "random_subset",
]
