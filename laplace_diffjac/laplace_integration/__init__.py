"""Everything that touches laplace-torch's classes, reversibly.

``register``/``unregister`` make every estimator accept this package's backends
(``_registration``); ``patch_laplace`` swaps laplace-torch's BackPACK backends for
ours while active (``_drop_in``). Both are reversible replacements of single class
attributes (``_patching``), decided by ``issubclass``. ``LocationFunctionalLaplace``
is laplace-torch's ``FunctionalLaplace`` on given locations
(``_functional_laplace``), the one subclass of a laplace-torch estimator here.
While registered, estimators with our backends fit the union of the ranks' shards
under a ``torch.distributed`` group (``_distributed_fit``,
``_distributed_functional``, ``_distributed_tuning``). ``kron_evidence_hyperparameters``
chooses ``δ`` and ``σ`` by the KFAC Laplace evidence, as laplace-bayesopt does
(for :class:`~laplace_diffjac.bayesopt.ContextBoTorch`).
"""

from ._compat import LAPLACE_VERSION
from ._drop_in import LaplacePatch, is_patched, patch_laplace
from ._functional_laplace import (
    LocationFunctionalLaplace,
    functional_laplace_on_locations,
)
from ._kron_evidence import kron_evidence_hyperparameters
from ._registration import (
    is_registered,
    is_side_effect_free,
    register,
    unregister,
)

__all__ = [
    "LAPLACE_VERSION",
    "LaplacePatch",
    "LocationFunctionalLaplace",
    "is_patched",
    "is_registered",
    "functional_laplace_on_locations",
    "kron_evidence_hyperparameters",
    "is_side_effect_free",
    "patch_laplace",
    "register",
    "unregister",
]
