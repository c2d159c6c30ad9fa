"""Bayesian optimisation on the context posterior (needs the ``bayesopt`` extra).

>>> from laplace_diffjac.bayesopt import ContextBoTorch, RetrainSchedule

:class:`ContextBoTorch` is a BoTorch ``Model``: the context posterior of a trained
network (by default exact on the observations) with the dual mean, joint over
q-batches and differentiable in the query points; between the retrainings of a
:class:`RetrainSchedule` new observations fine-tune the network and refit the
posterior, or are dual updates (``finetune_epochs=0``).
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
