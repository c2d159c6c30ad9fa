"""The demo's plot: one panel layout per task, every axis labelled."""

from __future__ import annotations

import pytest

from laplace_diffjac.examples import run_demo
from laplace_diffjac.examples.plotting import _figure, plot

plt = pytest.importorskip("matplotlib.pyplot")


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_every_axis_of_the_plot_is_labelled(tmp_path, task):
    result = run_demo(task, quick=True, progress_bar=False)
    fig = _figure(result)
    try:
        axes = fig.get_axes()
        # regression: data and variance panels; classification: 5 maps with a
        # colour bar each and the objective's trace
        assert len(axes) == (2 if task == "regression" else 6 + 5)
        for ax in axes:
            if ax.get_label() == "<colorbar>":
                assert ax.get_ylabel(), ax
            else:
                assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), ax
    finally:
        plt.close(fig)
    path = tmp_path / f"{task}.png"
    assert plot(result, str(path)) == str(path) and path.stat().st_size > 1000
