"""Context locations: choose them through the NTK and use them in a posterior.

Two products over one data layer (:mod:`laplace_diffjac.data`):

* :mod:`.locations` — ``optimize_locations`` moves ``M`` locations to minimise the
  likelihood-weighted Nyström gap (``nystrom_gap``), starting from a random subset
  or k-means (``random_subset``, ``kmeans``), with its options in
  ``LocationSettings``;
* :mod:`.posterior` — ``ContextPosterior``, the DTC linearised-Laplace posterior
  that sees all ``N`` training points through the locations, and
  ``evidence_loss_backward``, its evidence bound as an objective in the locations
  and the hyperparameters (exact full-data gradient).

``locations`` may import ``posterior`` (the evidence objective), never the other
way round. laplace-torch's ``FunctionalLaplace`` on given locations,
``LocationFunctionalLaplace``, lives with the rest of the laplace-torch code in
:mod:`laplace_diffjac.laplace_integration` (the layer above this one); its old
names here, deprecated in 0.1.0, are gone, and asking for them says where they are.
"""

from .locations import (
    LocationHistory,
    LocationResult,
    LocationSettings,
    initial_locations,
    kmeans,
    nystrom_gap,
    optimize_locations,
    random_subset,
)
from .posterior import ContextPosterior, evidence_loss_backward

__all__ = [
    "ContextPosterior",
    "LocationHistory",
    "LocationResult",
    "LocationSettings",
    "evidence_loss_backward",
    "initial_locations",
    "kmeans",
    "nystrom_gap",
    "optimize_locations",
    "random_subset",
]

#: Names removed from this layer, and where they live now.
_MOVED = ("LocationFunctionalLaplace", "functional_laplace_on_locations")


def __getattr__(name: str) -> object:
    """Refuse the removed names with where they are now; nothing is imported.

    Raises
    ------
    AttributeError
        For every name this module does not define.
    """
    if name in _MOVED:
        raise AttributeError(
            f"laplace_diffjac.context.{name} was removed (deprecated since 0.1.0): "
            f"import it from laplace_diffjac.laplace_integration, or as "
            f"laplace_diffjac.{name}."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
