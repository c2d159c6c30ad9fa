"""Saving and loading a ``ContextPosterior`` (tensors and plain values only).

The functions take the posterior as ``Any``: typing it would import
``_posterior``, which imports this module.
"""

from __future__ import annotations

from typing import Any

from ._hyperparameters import PriorGroups
from ._statistics import Accumulators

__all__ = ["load_posterior_state", "posterior_state"]

_FORMAT = "laplace_diffjac.ContextPosterior/3"
_FORMATS = (  # readable
    _FORMAT,
    "laplace_diffjac.ContextPosterior/2",
    "laplace_diffjac.ContextPosterior/1",
)


def posterior_state(posterior: Any) -> dict[str, Any]:
    """The state of ``ContextPosterior.state_dict`` (see there).

    Returns
    -------
    dict

    """
    acc, groups = posterior._fitted()
    return {
        "format": _FORMAT,
        "mean": posterior.mean,
        "param_shapes": [list(p.shape) for p in posterior.backend.params],
        "likelihood": posterior.likelihood,
        "locations": posterior.locations,
        "prior_precision": posterior.prior_precision.detach(),
        "prior_mean": posterior.prior_mean.detach(),
        "sigma_noise": posterior.sigma_noise.detach(),
        "temperature": float(posterior.temperature),
        "enable_backprop": bool(posterior.enable_backprop),
        "jitter": float(posterior.jitter),
        "prior_structure": groups.structure,
        "group_bounds": [list(b) for b in groups.bounds],
        "group_weight": groups.weight,
        "accumulators": acc.to_state(),
    }


def load_posterior_state(posterior: Any, state_dict: dict[str, Any]) -> None:
    """Restore ``state_dict`` into ``posterior`` (``ContextPosterior.load_state_dict``).

    Raises
    ------
    ValueError
        If it is not a ContextPosterior state, or the parameter count, the
        parameter shapes or the likelihood differ.

    """
    if state_dict.get("format") not in _FORMATS:
        raise ValueError("Loading a wrong Laplace type: not a ContextPosterior state.")
    if len(state_dict["mean"]) != posterior.n_params or state_dict["param_shapes"] != [
        list(p.shape) for p in posterior.backend.params
    ]:
        raise ValueError(
            "Attempting to load a ContextPosterior fitted on a model with "
            "different parameters (count or shapes) than this one's."
        )
    if posterior.likelihood != state_dict["likelihood"]:
        raise ValueError(
            f"Different likelihoods: saved {state_dict['likelihood']!r}, this "
            f"posterior {posterior.likelihood!r}."
        )
    posterior.locations = state_dict["locations"].to(posterior._device)
    posterior.prior_precision = state_dict["prior_precision"]
    posterior.prior_mean = state_dict["prior_mean"]
    posterior.sigma_noise = state_dict["sigma_noise"]
    posterior.temperature = state_dict["temperature"]
    posterior.enable_backprop = state_dict["enable_backprop"]
    posterior.jitter = state_dict["jitter"]
    bounds = tuple(tuple(b) for b in state_dict["group_bounds"])
    posterior._groups = PriorGroups(
        state_dict["prior_structure"],
        bounds,
        state_dict["group_weight"],
        posterior.n_layers,
    )
    posterior._acc = Accumulators.from_state(
        state_dict["accumulators"],
        posterior._groups,
        posterior.jitter,
        posterior._location_features(),
    )
    posterior._linear = posterior._linear_route(posterior._groups, whole=True)
    posterior._factors.clear()
