"""Bayesian optimisation on the context posterior (needs the ``bayesopt`` extra).

>>> from laplace_diffjac.bayesopt import ContextBoTorch, RetrainSchedule

:class:`ContextBoTorch` is a BoTorch ``Model``: the context posterior of a trained
network with the dual mean, joint over q-batches and differentiable in the
query points; new observations are dual updates (no retraining) between the
retrainings of a :class:`RetrainSchedule`.
"""

try:
    import botorch  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "laplace_diffjac.bayesopt needs BoTorch: pip install "
        "'laplace-diffjac[bayesopt]'."
    ) from error

from ._model import ContextBoTorch
from ._schedule import RetrainSchedule

__all__ = ["ContextBoTorch", "RetrainSchedule"]
