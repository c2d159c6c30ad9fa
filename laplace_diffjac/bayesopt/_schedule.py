"""When a :class:`~laplace_diffjac.bayesopt.ContextBoTorch` retrains its network."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidInputError

__all__ = ["RetrainSchedule"]


@dataclass(frozen=True)
class RetrainSchedule:
    """Retrain the network, the locations and ``δ``/``σ``, fine-tune, or update.

    A retraining trains a fresh network on all observations, chooses the
    locations again and tunes ``δ`` (and ``σ``) by the evidence. It happens when
    either condition below holds after an update is counted. An update is one
    call of ``condition_on_observations``: one Bayesian-optimisation iteration,
    one observation at ``q = 1`` and a batch of ``q`` otherwise, as
    laplace-bayesopt's ``LaplaceBoTorch`` retrains once per call. Between
    retrainings every update fine-tunes the network (``finetune_epochs``) and
    fits the posterior again, or, with ``finetune_epochs=0``, is a dual update
    of the context posterior (its covariance and its dual mean move; the
    network stays). With the
    observations as locations (``ContextBoTorch(locations='observations')``,
    while they fit) the posterior is fitted again in any case: the new
    observation becomes a location.

    Attributes
    ----------
    every : int or None, default=10
        Retrain at this many updates since the last training, whatever their
        batch size: one retraining for every ``every`` of ``LaplaceBoTorch``'s,
        at any ``q`` (``None``: never on count).
    evidence_drop : float or None, default=None
        Retrain when the log evidence per observation, after the dual update,
        fell by more than this below its value after the last training: the
        network explains the new data worse than the old (``None``: never on
        evidence).
    finetune_epochs : int, default=50
        Between retrainings, train the current network this many further epochs
        on all observations after every update (warm-started, a tenth of the
        training's learning rate), then fit the posterior again with the
        hyperparameters of the last training (``0``: dual updates only, the
        network fixed).

    Raises
    ------
    InvalidInputError
        On creation, for ``every < 1``, a negative or non-finite
        ``evidence_drop`` or a negative ``finetune_epochs``.

    """

    every: int | None = 10
    evidence_drop: float | None = None
    finetune_epochs: int = 50

    def __post_init__(self) -> None:
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int)
            or self.every < 1
        ):  # fmt: skip
            raise InvalidInputError(
                f"RetrainSchedule.every must be a positive int or None, got "
                f"{self.every!r}."
            )
        epochs = self.finetune_epochs
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise InvalidInputError(
                f"RetrainSchedule.finetune_epochs must be an int >= 0, got {epochs!r}."
            )
        drop = self.evidence_drop
        if drop is not None and not (math.isfinite(drop) and drop >= 0):
            raise InvalidInputError(
                "RetrainSchedule.evidence_drop must be a finite number >= 0 or None, "
                f"got {drop!r}."
            )

    def due_on_count(self, updates: int) -> bool:
        """Whether ``updates`` updates since the last training call for one.

        Returns
        -------
        bool

        """
        return self.every is not None and updates >= self.every

    def due_on_evidence(self, per_point: float, at_training: float) -> bool:
        """Whether the evidence per observation dropped too far since training.

        Returns
        -------
        bool

        """
        if self.evidence_drop is None:
            return False
        return per_point < at_training - self.evidence_drop
