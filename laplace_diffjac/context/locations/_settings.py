"""The location optimiser's options as one typed, validated, frozen object."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from ...errors import InvalidInputError

__all__ = ["LocationSettings", "resolve_settings"]


@dataclass(frozen=True)
class LocationSettings:
    """Options of :func:`laplace_diffjac.optimize_locations` (validated on creation).

    Attributes
    ----------
    steps : int, default=200
        Maximum number of Adam steps, ``>= 0``.
    lr : float, optional
        Adam learning rate ``> 0``; default ``0.05`` times the inputs' mean
        standard deviation per feature.
    batch_size : int, default=256
        Minibatch size over the training inputs, ``>= 1``.
    patience : int, default=50
        Stop after this many steps without a relative improvement of ``rel_tol``
        in the smoothed (EMA) objective; ``0`` disables early stopping.
    rel_tol : float, default=1e-4
        Relative improvement that counts, ``>= 0``.
    jitter : float, default=1e-6
        Relative diagonal jitter of ``K_ZZ``, ``>= 0``.
    seed : int, default=0
        Seeds the initialisation (``torch.Generator().manual_seed(seed)``) and,
        through an independent stream derived from it, the minibatch order.
    progress_bar : bool, default=True
        Show a tqdm progress bar.
    chunk_size : int, default=256
        Training inputs whose pieces (Jacobians or features) are computed at once.
    cache_jacobians : bool, optional
        Keep the training side's pieces (per-layer features on the structured
        route, Jacobians ``(N, C, P)`` otherwise) for every step; ``None``: when
        they take at most 512 MiB. ``Λₙ`` and ``tr(Λₙ k(xₙ, xₙ))`` are always
        computed once.
    evaluate_full : bool, default=False
        Also evaluate the objective on all ``N`` inputs before and after
        optimising (``LocationHistory.initial_objective``/``final_objective``;
        NaN otherwise). Costs two passes over the data.
    structured : bool, optional
        ``None``: the structured Gram (never forming ``J``) where it applies
        (chains of Linear layers and elementwise activations, scalar prior,
        all parameters), else Jacobians; ``True``: require it; ``False``: always
        Jacobians.
    stream : bool, optional
        Stream a ``DataLoader`` instead of gathering its inputs: one pass for
        ``N``, the default ``lr`` and the initial locations, then every step
        evaluates the loader's next batch (``Λₙ`` and pieces for that batch
        only). ``None``: stream exactly when the loader's dataset is an
        ``IterableDataset`` (it cannot be indexed, and may not fit in memory).
        Ignored for tensors.
    max_inputs : int, default=10000
        Most inputs held at once for the initialisation: the k-means
        subsample (in memory and streaming) and the streaming reservoir.
    threads : int, optional
        PyTorch threads for the optimisation steps (restored afterwards).
        ``None``: one thread when ``M·C <= 256``, where a step is too small to
        gain from more and PyTorch's thread pool lost 5× in wall time to two busy
        processes beside it (``benchmarks/optimizer/optimizer_defaults.py
        threads``), else PyTorch's own setting.

    Raises
    ------
    InvalidInputError
        On creation, for an option out of range; the message names it.

    """

    steps: int = 200
    lr: float | None = None
    batch_size: int = 256
    patience: int = 50
    rel_tol: float = 1e-4
    jitter: float = 1e-6
    seed: int = 0
    progress_bar: bool = True
    chunk_size: int = 256
    cache_jacobians: bool | None = None
    evaluate_full: bool = False
    structured: bool | None = None
    stream: bool | None = None
    max_inputs: int = 10_000
    threads: int | None = None

    def __post_init__(self) -> None:
        """Check every option; raise naming the first one out of range."""
        _need(self.steps >= 0, "steps", "a number of Adam steps >= 0", self.steps)
        _need(self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size)
        _need(self.chunk_size >= 1, "chunk_size", "an integer >= 1", self.chunk_size)
        _need(self.max_inputs >= 1, "max_inputs", "an integer >= 1", self.max_inputs)
        ok_threads = self.threads is None or self.threads >= 1
        _need(ok_threads, "threads", "an integer >= 1 or None", self.threads)
        _need(self.patience >= 0, "patience", ">= 0 (0 disables it)", self.patience)
        ok_lr = self.lr is None or (math.isfinite(self.lr) and self.lr > 0)
        _need(ok_lr, "lr", "a finite learning rate > 0 or None", self.lr)
        ok_tol = math.isfinite(self.rel_tol) and self.rel_tol >= 0
        _need(ok_tol, "rel_tol", "a finite number >= 0", self.rel_tol)
        ok_jitter = math.isfinite(self.jitter) and self.jitter >= 0
        _need(ok_jitter, "jitter", "a finite relative jitter >= 0", self.jitter)


def _need(ok: bool, name: str, what: str, value: object) -> None:
    if not ok:
        raise InvalidInputError(f"{name} must be {what}; got {value!r}.")


def resolve_settings(
    settings: LocationSettings | None, options: dict[str, Any]
) -> LocationSettings:
    """The settings: ``settings`` (or the defaults) with the keyword options on top.

    A keyword option given together with ``settings`` replaces that field
    (``dataclasses.replace``): it is never dropped, also when it equals the
    field's default.

    Parameters
    ----------
    settings : LocationSettings, optional
        Settings passed as one object.
    options : dict
        Keyword options named as the fields of :class:`LocationSettings`.

    Returns
    -------
    LocationSettings

    Raises
    ------
    InvalidInputError
        For a keyword that is not a field of :class:`LocationSettings`, a
        ``settings`` of another type, or an option out of range.

    """
    names = [f.name for f in fields(LocationSettings)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise InvalidInputError(
            f"optimize_locations got unknown options {unknown}; the options are "
            f"the fields of LocationSettings: {names}."
        )
    if settings is None:
        return LocationSettings(**options)
    if not isinstance(settings, LocationSettings):
        raise InvalidInputError(
            f"settings must be a LocationSettings, got {type(settings).__name__}."
        )
    return replace(settings, **options) if options else settings
