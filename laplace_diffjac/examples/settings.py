"""Sizes and hyperparameters of the demo problems."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoSettings"]


@dataclass(frozen=True)
class DemoSettings:
    """Sizes and hyperparameters of one demo run (see :meth:`for_task`).

    ``data_noise`` is the target noise of the regression data and the input noise
    of two moons; ``label_noise`` the fraction of flipped two-moons labels;
    ``patience`` the early-stopping patience of the location optimiser;
    ``evidence_m`` the number of optimised locations of the context posterior whose
    evidence chooses the prior precision (default ``2 m``; see
    :mod:`laplace_diffjac.examples._hyperparameters`).
    """

    task: str
    n: int
    m: int
    steps: int
    train_steps: int
    hidden: int
    sigma_noise: float
    prior_precision: float
    lr: float
    data_noise: float = 0.1
    label_noise: float = 0.0
    patience: int = 100
    evidence_m: int = 0

    @classmethod
    def for_task(
        cls, task: str, m: int | None, steps: int | None, quick: bool
    ) -> DemoSettings:
        """Return the default settings of a task, optionally overridden.

        Parameters
        ----------
        task : {'regression', 'classification'}
            The problem.
        m : int, optional
            Number of locations; default 4 % of ``n``.
        steps : int, optional
            Optimisation steps.
        quick : bool
            Smaller problem and fewer steps (smoke test).

        Returns
        -------
        DemoSettings
            The settings.

        Raises
        ------
        ValueError
            For an unknown task.

        """
        if task not in ("regression", "classification"):
            raise ValueError(f"Unknown task {task!r}.")
        n = 200 if quick else 400
        regression = task == "regression"
        m = m if m is not None else max(2, (4 * n) // 100)
        return cls(
            task=task,
            n=n,
            m=m,
            steps=steps if steps is not None else (30 if quick else 200),
            train_steps=300 if quick else 1000,
            hidden=50,
            sigma_noise=0.1 if regression else 1.0,
            prior_precision=1.0,
            lr=0.1,
            data_noise=0.1 if regression else 0.15,
            label_noise=0.0 if regression else 0.1,
            patience=30,
            evidence_m=min(2 * m, n),
        )
