"""Small problems for examples, notebooks and the command-line demo.

Data generators and a training helper; no plotting here (see
:mod:`laplace_diffjac.examples.plotting`, which needs matplotlib).
"""

from ._demo import (
    DemoResult,
    DemoSettings,
    format_table,
    make_moons,
    make_regression_gap,
    run_demo,
    train_mlp,
)

__all__ = [
    "DemoResult",
    "DemoSettings",
    "format_table",
    "make_moons",
    "make_regression_gap",
    "run_demo",
    "train_mlp",
]
