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

    @property
    def n_outputs(self) -> int:
        """Number of network outputs ``C``."""
        if self.task == "regression":
            return 1
        return int(self.y_train.max()) + 1


def _standardise(train: np.ndarray, *others: np.ndarray) -> tuple[np.ndarray, ...]:
    mean, std = train.mean(axis=0), train.std(axis=0)
    std = np.where(std > 0, std, 1.0)  # constant pixels of digits
    return tuple((a - mean) / std for a in (train, *others))


def load_split(
    name: str, seed: int, fractions: tuple[float, float, float] = (0.7, 0.15, 0.15)
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

    Returns
    -------
    Split
        Standardised tensors.

    Raises
    ------
    ValueError
        For an unknown name.

    """
    if name not in DATASETS:
        raise ValueError(f"Unknown data set {name!r}; choose from {sorted(DATASETS)}.")
    spec = DATASETS[name]
    X, y = spec.loader(return_X_y=True)
    X = X.astype(np.float64)
    strat = y if spec.task == "classification" else None
    n_test = fractions[2]
    X_rest, X_te, y_rest, y_te = train_test_split(
        X, y, test_size=n_test, stratify=strat, random_state=seed
    )
    strat = y_rest if spec.task == "classification" else None
    X_tr, X_va, y_tr, y_va = train_test_split(
        X_rest,
        y_rest,
        test_size=fractions[1] / (fractions[0] + fractions[1]),
        stratify=strat,
        random_state=seed,
    )
    X_tr, X_va, X_te = _standardise(X_tr, X_va, X_te)
    if spec.task == "regression":
        y_tr, y_va, y_te = _standardise(
            y_tr.reshape(-1, 1), y_va.reshape(-1, 1), y_te.reshape(-1, 1)
        )
        ys = [torch.tensor(a, dtype=torch.float32) for a in (y_tr, y_va, y_te)]
    else:
        ys = [torch.tensor(a, dtype=torch.int64) for a in (y_tr, y_va, y_te)]
    xs = [torch.tensor(a, dtype=torch.float32) for a in (X_tr, X_va, X_te)]
    return Split(name, spec.task, xs[0], ys[0], xs[1], ys[1], xs[2], ys[2])
