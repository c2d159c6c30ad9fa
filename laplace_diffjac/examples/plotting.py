"""Plots of a demo run (needs matplotlib: ``pip install "laplace-diffjac[plot]"``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .demo import DemoResult

__all__ = ["plot"]


def plot(result: DemoResult, path: str) -> str:
    """Write a PNG comparing the posteriors and the locations.

    Parameters
    ----------
    result : DemoResult
        A finished run.
    path : str
        Output file.

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    ImportError
        If matplotlib is not installed (the message says how to install it).

    """
    fig = _figure(result)  # checks for matplotlib first
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _figure(result: DemoResult) -> Any:
    """The figure of :func:`plot`, open (the caller closes it).

    Parameters
    ----------
    result : DemoResult
        A finished run.

    Returns
    -------
    matplotlib.figure.Figure
        Its panels, every axis labelled.

    Raises
    ------
    ImportError
        If matplotlib is not installed (the message says how to install it).

    """
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError(
            "Plotting needs matplotlib: pip install 'laplace-diffjac[plot]' "
            "(or pip install matplotlib)."
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result.settings.task == "regression":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        _regression_panels(axes, result)
    else:
        fig, axes = plt.subplots(2, 3, figsize=(14, 8))
        _classification_panels(fig, axes, result)
    fig.tight_layout()
    return fig


def _regression_panels(axes: Any, result: DemoResult) -> None:
    x, y, grid = result.data["x"], result.data["y"], result.data["grid"]
    curves, locs = result.curves, result.locations
    axes[0].scatter(x[:, 0], y[:, 0], s=4, c="0.6", label="data")
    for name, colour, height in (
        ("random", "tab:red", -2.2),
        ("optimised", "tab:green", -2.4),
    ):
        axes[0].plot(
            locs[name][:, 0],
            [height] * len(locs[name]),
            "|",
            ms=12,
            c=colour,
            label=f"{name} locations",
        )
    axes[0].set_title("data and context locations")
    axes[0].set_xlabel("x")
    axes[0].set_ylabel("y")
    axes[0].legend(fontsize=8)
    g = grid[:, 0]
    axes[1].plot(g, curves["full"].log()[:, 0], "k", lw=2, label="full GGN Laplace")
    for key, style in (
        ("ContextPosterior/random", "r--"),
        ("ContextPosterior/optimised", "g--"),
        ("FunctionalLaplace/random", "r:"),
        ("FunctionalLaplace/optimised", "g:"),
    ):
        axes[1].plot(g, curves[key].log()[:, 0], style, label=key)
    axes[1].set_title("log latent predictive variance")
    axes[1].set_xlabel("x")
    axes[1].set_ylabel("log variance")
    axes[1].legend(fontsize=7)


def _classification_panels(fig: Any, axes: Any, result: DemoResult) -> None:
    x, y, grid = result.data["x"], result.data["y"], result.data["grid"]
    curves, locs = result.curves, result.locations
    n = int(round(math.sqrt(grid.shape[0])))
    g0, g1 = grid[:, 0].reshape(n, n), grid[:, 1].reshape(n, n)
    full_log = curves["full"].log()
    ax = axes[0, 0]
    c = ax.contourf(g0, g1, full_log.mean(-1).reshape(n, n), levels=20)
    fig.colorbar(c, ax=ax, label="mean log variance")
    ax.scatter(x[:, 0], x[:, 1], c=y, s=3, cmap="coolwarm", alpha=0.5)
    ax.set_title("full GGN Laplace: mean log latent var")
    _input_labels(ax)
    panels = [
        (axes[0, 1], "FunctionalLaplace", "random"),
        (axes[0, 2], "FunctionalLaplace", "optimised"),
        (axes[1, 1], "ContextPosterior", "random"),
        (axes[1, 2], "ContextPosterior", "optimised"),
    ]
    errors = {
        (method, loc): (curves[f"{method}/{loc}"].log() - full_log).abs().mean(-1)
        for _, method, loc in panels
    }
    top = max(float(e.max()) for e in errors.values()) or 1.0
    levels = torch.linspace(0, top, 21).tolist()
    for ax, method, loc in panels:
        err = errors[(method, loc)]
        c = ax.contourf(g0, g1, err.reshape(n, n), levels=levels, cmap="magma")
        fig.colorbar(c, ax=ax, label="|Δ log variance|")
        ax.scatter(x[:, 0], x[:, 1], c="0.7", s=2, alpha=0.5)
        ax.scatter(locs[loc][:, 0], locs[loc][:, 1], marker="x", c="c", s=40)
        ax.set_title(
            f"{method}, {loc}: |Δ log var| (mean {err.mean():.3f})", fontsize=9
        )
        _input_labels(ax)
    ax = axes[1, 0]
    if result.history is not None:
        ax.semilogy(result.history.objective)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("objective")
    ax.set_title("Nyström gap (minibatch estimate)")


def _input_labels(ax: Any) -> None:
    ax.set_xlabel("$x_1$")
    ax.set_ylabel("$x_2$")
