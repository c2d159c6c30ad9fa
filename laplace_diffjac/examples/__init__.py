"""Small problems for examples, notebooks and the command-line demo.

* :mod:`~laplace_diffjac.examples.datasets` — 1-D regression with a gap, noisy
  two moons;
* :mod:`~laplace_diffjac.examples.training` — MAP training of a small tanh MLP;
* :mod:`~laplace_diffjac.examples.settings` — the demo's sizes and hyperparameters;
* :mod:`~laplace_diffjac.examples.demo` — random versus optimised context
  locations, end to end (what ``python -m laplace_diffjac`` runs);
* :mod:`~laplace_diffjac.examples.plotting` — its plot (needs matplotlib, not
  imported here).
"""

from .datasets import make_moons, make_regression_gap
from .demo import DemoResult, format_table, run_demo
from .settings import DemoSettings
from .training import train_mlp

__all__ = [
    "DemoResult",
    "DemoSettings",
    "format_table",
    "make_moons",
    "make_regression_gap",
    "run_demo",
    "train_mlp",
]
