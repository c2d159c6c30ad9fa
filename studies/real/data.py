"""Real data sets bundled with scikit-learn, splits and standardisation.

Every data set ships inside the scikit-learn wheel (``sklearn/datasets/data``);
nothing is downloaded at run time (no ``fetch_*`` function is used).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

try:
    from sklearn import datasets
    from sklearn.model_selection import train_test_split
except ImportError as error:  # the study's extra is not installed
    raise ImportError(
        "The real-data study needs scikit-learn (its data sets): "
        'pip install -e ".[study]" from the repository root.'
    ) from error

__all__ = ["DATASETS", "DataSpec", "Split", "load_split"]


@dataclass(frozen=True)
class DataSpec:
    """A bundled data set: loader, task and provenance."""

    loader: Callable[..., tuple[np.ndarray, np.ndarray]]
    task: str  # 'classification' or 'regression'
    source: str
    licence: str


DATASETS: dict[str, DataSpec] = {
    "digits": DataSpec(
        datasets.load_digits,
        "classification",
        "UCI ML hand-written digits (8x8 test set copy), 1797 x 64, 10 classes",
        "CC BY 4.0 (UCI); bundled with scikit-learn (BSD-3-Clause)",
    ),
    "breast_cancer": DataSpec(
        datasets.load_breast_cancer,
        "classification",
        "UCI Breast Cancer Wisconsin (Diagnostic), 569 x 30, 2 classes",
        "CC BY 4.0 (UCI); bundled with scikit-learn (BSD-3-Clause)",
    ),
    "wine": DataSpec(
        datasets.load_wine,
        "classification",
        "UCI Wine recognition, 178 x 13, 3 classes",
        "CC BY 4.0 (UCI); bundled with scikit-learn (BSD-3-Clause)",
    ),
    "diabetes": DataSpec(
        datasets.load_diabetes,
        "regression",
        "Efron et al. (2004) diabetes, 442 x 10, disease progression",
        "as distributed with scikit-learn (BSD-3-Clause); original data from "
        "Efron, Hastie, Johnstone, Tibshirani (2004)",
    ),
}


@dataclass
class Split:
    """Standardised train/validation/test tensors of one seed.

    Inputs ``(n, D)`` float32 are standardised with the training mean and
    standard deviation; regression targets ``(n, 1)`` likewise (metrics are then
    in units of the training targets' standard deviation); class labels are
    ``(n,)`` int64.
    """

    name: str
    task: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    #: The unstandardised test inputs and the training statistics (for corruptions
    #: applied before standardisation, ``corruptions.py``).
    x_test_raw: torch.Tensor | None = None
    x_mean: torch.Tensor | None = None
    x_std: torch.Tensor | None = None
    #: Test inputs of the held-out classes (standardised like the rest), if any.
    x_ood: torch.Tensor | None = None
    y_ood: torch.Tensor | None = None

    def standardise(self, raw: torch.Tensor) -> torch.Tensor:
        """Standardise raw inputs ``(n, D)`` with the training statistics."""
        if self.x_mean is None or self.x_std is None:
            raise ValueError("This split has no training statistics recorded.")
        return ((raw.double() - self.x_mean) / self.x_std).float()

    @property
    def n_outputs(self) -> int:
        """Number of network outputs ``C``."""
        if self.task == "regression":
            return 1
        return int(self.y_train.max()) + 1


def _stats(train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    std = train.std(axis=0)
    return train.mean(axis=0), np.where(std > 0, std, 1.0)  # constant digit pixels


def _standardise(train: np.ndarray, *others: np.ndarray) -> tuple[np.ndarray, ...]:
    mean, std = _stats(train)
    return tuple((a - mean) / std for a in (train, *others))


def _keep(classes: tuple[int, ...] | None, *pairs: tuple) -> list:
    """Each ``(X, y)`` restricted to ``classes`` (all when ``None``)."""
    if classes is None:
        return list(pairs)
    return [(X[np.isin(y, classes)], y[np.isin(y, classes)]) for X, y in pairs]


def _three_way(spec: DataSpec, seed: int, fractions: tuple[float, float, float]):
    """Raw train, validation and test arrays (stratified for classes)."""
    X, y = spec.loader(return_X_y=True)
    X = X.astype(np.float64)
    strat = y if spec.task == "classification" else None
    X_rest, X_te, y_rest, y_te = train_test_split(
        X, y, test_size=fractions[2], stratify=strat, random_state=seed
    )
    strat = y_rest if spec.task == "classification" else None
    X_tr, X_va, y_tr, y_va = train_test_split(
        X_rest,
        y_rest,
        test_size=fractions[1] / (fractions[0] + fractions[1]),
        stratify=strat,
        random_state=seed,
    )
    return X_tr, y_tr, X_va, y_va, X_te, y_te


def load_split(
    name: str,
    seed: int,
    fractions: tuple[float, float, float] = (0.7, 0.15, 0.15),
    keep_classes: tuple[int, ...] | None = None,
) -> Split:
    """Load a bundled data set and split it 70/15/15 (stratified for classes).

    Parameters
    ----------
    name : str
        A key of :data:`DATASETS`.
    seed : int
        Seed of the split.
    fractions : tuple of float, default=(0.7, 0.15, 0.15)
        Train, validation and test shares.
    keep_classes : tuple of int, optional
        Held-out classes: train, validate and test on these classes ``0..K−1``
        only (the splits are those of all classes, then filtered); the test inputs
        of the other classes become ``x_ood``/``y_ood``.

    Returns
    -------
    Split
        Standardised tensors.

    Raises
    ------
    ValueError
        For an unknown name, or classes that are not ``0..K−1`` of a
        classification data set.

    """
    if name not in DATASETS:
        raise ValueError(f"Unknown data set {name!r}; choose from {sorted(DATASETS)}.")
    spec = DATASETS[name]
    if keep_classes is not None and (
        spec.task != "classification"
        or tuple(keep_classes) != tuple(range(len(keep_classes)))
    ):
        raise ValueError(
            f"keep_classes must be 0..K-1 of a classification data set, got "
            f"{keep_classes!r} for {name!r}; e.g. keep_classes=(0, 1, 2, 3, 4)."
        )
    X_tr, y_tr, X_va, y_va, X_te, y_te = _three_way(spec, seed, fractions)
    ood = None
    if keep_classes is not None:
        out = ~np.isin(y_te, keep_classes)
        ood = (X_te[out], y_te[out])
    (X_tr, y_tr), (X_va, y_va), (X_te, y_te) = _keep(
        keep_classes, (X_tr, y_tr), (X_va, y_va), (X_te, y_te)
    )
    mean, std = _stats(X_tr)
    raw_test = torch.tensor(X_te, dtype=torch.float64)
    if ood is not None:
        x_ood = torch.tensor((ood[0] - mean) / std, dtype=torch.float32)
        ood = (x_ood, torch.tensor(ood[1], dtype=torch.int64))
    X_tr, X_va, X_te = _standardise(X_tr, X_va, X_te)
    if spec.task == "regression":
        y_tr, y_va, y_te = _standardise(
            y_tr.reshape(-1, 1), y_va.reshape(-1, 1), y_te.reshape(-1, 1)
        )
        ys = [torch.tensor(a, dtype=torch.float32) for a in (y_tr, y_va, y_te)]
    else:
        ys = [torch.tensor(a, dtype=torch.int64) for a in (y_tr, y_va, y_te)]
    xs = [torch.tensor(a, dtype=torch.float32) for a in (X_tr, X_va, X_te)]
    pairs = [t for pair in zip(xs, ys) for t in pair]
    return Split(
        name,
        spec.task,
        *pairs,
        x_test_raw=raw_test,
        x_mean=torch.tensor(mean),
        x_std=torch.tensor(std),
        x_ood=None if ood is None else ood[0],
        y_ood=None if ood is None else ood[1],
    )
