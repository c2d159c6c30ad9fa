"""``Laplace(..., functional_approximation='context')`` builds a ContextPosterior.

laplace-torch 0.3's factory ``laplace.Laplace`` selects a function-space method
with ``functional_approximation`` (``'sod'``, ``'nystrom'``, ``'variational'``).
While registered, the factory also accepts ``'context'`` with
``subset_of_weights='all'`` and ``hessian_structure='gp'``, and the locations as
``context_points``::

    la = Laplace(model, "regression", subset_of_weights="all",
                 hessian_structure="gp", functional_approximation="context",
                 context_points=Z, backend=DiffBackPackGGN)

Every other call goes to laplace-torch's factory unchanged. The factory is replaced
where laplace-torch defines it (``laplace.laplace.Laplace``) and where it re-exports
it (``laplace.Laplace``); a ``from laplace import Laplace`` executed before
registration keeps the original function. laplace-torch 0.2.3 has no
``functional_approximation``; there nothing is patched (use
:class:`~laplace_diffjac.context.ContextPosterior` directly).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import laplace
import laplace.laplace as laplace_module

from ._patching import AttributePatch

__all__ = ["factory_patches"]


def _with_context(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def Laplace(  # noqa: N802 (laplace-torch's name)
        model: Any,
        likelihood: Any,
        subset_of_weights: Any = "last_layer",
        hessian_structure: Any = "kron",
        *args: Any,
        functional_approximation: Any = "sod",
        **kwargs: Any,
    ) -> Any:
        if not (
            isinstance(functional_approximation, str)
            and functional_approximation == "context"
        ):
            return original(
                model, likelihood, subset_of_weights, hessian_structure, *args,
                functional_approximation=functional_approximation, **kwargs,
            )  # fmt: skip
        if subset_of_weights != "all" or hessian_structure != "gp" or args:
            raise ValueError(
                "functional_approximation='context' requires subset_of_weights='all' "
                "and hessian_structure='gp', and takes keyword arguments only."
            )
        if kwargs.get("context_points") is None:
            raise ValueError(
                "functional_approximation='context' needs context_points=Z, the "
                "locations (M, *input_shape)."
            )
        from ..context import ContextPosterior

        locations = kwargs.pop("context_points")
        return ContextPosterior(model, likelihood, locations, **kwargs)

    return Laplace


def factory_patches() -> list[AttributePatch]:
    """Patches of ``laplace.laplace.Laplace`` and ``laplace.Laplace`` (0.3 only).

    Returns
    -------
    list of AttributePatch
        Empty where the factory has no ``functional_approximation``.

    """
    original = vars(laplace_module).get("Laplace")
    if original is None:
        return []
    if "functional_approximation" not in inspect.signature(original).parameters:
        return []
    wrapped = _with_context(original)
    patches = [AttributePatch(laplace_module, "Laplace", wrapped)]
    if vars(laplace).get("Laplace") is original:
        patches.append(AttributePatch(laplace, "Laplace", wrapped))
    return patches
