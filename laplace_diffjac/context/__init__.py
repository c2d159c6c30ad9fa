"""Context locations: choose them through the NTK and use them in a posterior.

``optimize_locations`` moves ``M`` locations to minimise the likelihood-weighted
Nyström gap (``nystrom_gap``), starting from a random subset or k-means
(``random_subset``, ``kmeans``). ``ContextPosterior`` is the DTC linearised-Laplace
posterior that sees all ``N`` training points through the locations;
``LocationFunctionalLaplace`` is laplace-torch's ``FunctionalLaplace`` on given
locations. ``evidence_loss_backward`` is the posterior's evidence bound as an
objective in the locations and the hyperparameters (exact full-data gradient).
"""

from ._evidence_objective import evidence_loss_backward
from ._functional_laplace import (
    LocationFunctionalLaplace,
    functional_laplace_on_locations,
)
from ._init import initial_locations, kmeans, random_subset
from ._objective import nystrom_gap
from ._optimizer import LocationHistory, LocationResult, optimize_locations
from ._posterior import ContextPosterior
from ._settings import LocationSettings

__all__ = [
    "ContextPosterior",
    "LocationFunctionalLaplace",
    "LocationHistory",
    "LocationResult",
    "LocationSettings",
    "evidence_loss_backward",
    "functional_laplace_on_locations",
    "initial_locations",
    "kmeans",
    "nystrom_gap",
    "optimize_locations",
    "random_subset",
]
