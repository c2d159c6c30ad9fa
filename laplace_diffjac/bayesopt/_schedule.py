"""When a :class:`~laplace_diffjac.bayesopt.ContextBoTorch` retrains its network."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidInputError

__all__ = ["RetrainSchedule"]


@dataclass(frozen=True)
class RetrainSchedule:
    """Retrain the network, the locations and ``δ``/``σ``, or update the posterior.

    Between retrainings every new observation is a dual update of the context
    posterior (its covariance and its dual mean move; the network stays). A
    retraining trains a fresh network on all observations, chooses the
    locations again and tunes ``δ`` (and ``σ``) by the evidence. It happens when
    either condition below holds after the new observations are counted.

    Attributes
    ----------
    every : int or None, default=10
        Retrain once this many observations arrived since the last training
        (``None``: never on count).
    evidence_drop : float or None, default=None
        Retrain when the log evidence per observation, after the dual update,
        fell by more than this below its value after the last training: the
        network explains the new data worse than the old (``None``: never on
        evidence).

    Raises
    ------
    InvalidInputError
        On creation, for ``every < 1`` or a negative or non-finite
        ``evidence_drop``.

    """

    every: int | None = 10
    evidence_drop: float | None = None

    def __post_init__(self) -> None:
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int)
            or self.every < 1
        ):  # fmt: skip
            raise InvalidInputError(
                f"RetrainSchedule.every must be a positive int or None, got "
                f"{self.every!r}."
            )
        drop = self.evidence_drop
        if drop is not None and not (math.isfinite(drop) and drop >= 0):
            raise InvalidInputError(
                "RetrainSchedule.evidence_drop must be a finite number >= 0 or None, "
                f"got {drop!r}."
            )

    def due_on_count(self, since_training: int) -> bool:
        """Whether ``since_training`` new observations call for a retraining.

        Returns
        -------
        bool

        """
        return self.every is not None and since_training >= self.every

    def due_on_evidence(self, per_point: float, at_training: float) -> bool:
        """Whether the evidence per observation dropped too far since training.

        Returns
        -------
        bool

        """
        if self.evidence_drop is None:
            return False
        return per_point < at_training - self.evidence_drop
