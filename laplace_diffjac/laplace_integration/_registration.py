"""Make every laplace-torch estimator accept this package's backends.

laplace-torch restricts backends in two ways that matter here:

* ``FunctionalLaplace.__init__`` (hence ``FunctionalLLLaplace`` and
  ``Laplace(..., hessian_structure='gp')``) runs
  ``assert backend in [BackPackGGN, AsdlGGN, CurvlinopsGGN]``, which rejects
  ``DiffBackPackGGN`` and ``DiffFuncGGN``.
* In laplace-torch 0.3, ``BaseFunctionalLaplace._uses_backpack_backend``
  (``issubclass(backend, BackPackInterface)``) keeps ELLA and VaLLA off
  ``torch.func`` because BackPACK extends modules in place. The
  ``DiffBackPack*`` backends are BackPACK subclasses that never do, so for them
  the property is ``False``.

:func:`register` replaces exactly these two class attributes (the second only where
it exists) and :func:`unregister` puts the originals back. Everything else is left
as laplace-torch has it, on purpose:

* the checks that refuse dict-like inputs for BackPACK backends (by class name in
  ``fit``) also apply to ``DiffBackPackGGN``/``DiffBackPackEF``, which take tensor
  batches only (they raise :class:`~laplace_diffjac.errors.InvalidInputError`, a
  ``ValueError``, themselves); ``DiffFuncGGN`` takes dict-like inputs;
* the refusal of BackPACK backends when some parameters have
  ``requires_grad=False`` is kept for ``DiffBackPack*``;
* ``FunctionalLaplace`` stays a GGN method: ``DiffBackPackEF`` is rejected there
  exactly as ``BackPackEF`` is.

The decisions are made with ``issubclass``, never with class names.
"""

from __future__ import annotations

from typing import Any

from laplace import baselaplace
from laplace.baselaplace import FunctionalLaplace
from laplace.curvature import BackPackGGN, BackPackInterface, CurvlinopsGGN

from ..backends import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from ._backend_args import wrap_init
from ._factory import factory_patches
from ._patching import AttributePatch, SharedPatches

#: Backends that leave no hooks, attributes or gradients on the model.
SIDE_EFFECT_FREE_BACKENDS: tuple[type, ...] = (
    DiffBackPackGGN,
    DiffBackPackEF,
    DiffFuncGGN,
)

#: Those of them that compute the GGN, as ``FunctionalLaplace`` requires.
FUNCTIONAL_BACKENDS: tuple[type, ...] = (DiffBackPackGGN, DiffFuncGGN)


def is_side_effect_free(backend: Any) -> bool:
    """Whether ``backend`` is (a subclass of) one of this package's backends.

    Parameters
    ----------
    backend : object
        A backend class, or anything else (then the answer is ``False``).

    Returns
    -------
    bool

    """
    return isinstance(backend, type) and issubclass(backend, SIDE_EFFECT_FREE_BACKENDS)


def _functional_policy(backend: Any) -> tuple[Any, Any | None]:
    """Let ``FunctionalLaplace`` take our GGN backends past its allow-list.

    The constructor is given the laplace-torch class ours stands for (same
    constructor-time checks: BackPACK's for ``DiffBackPackGGN``, none for
    ``DiffFuncGGN``), and ours is installed once it returns.

    Parameters
    ----------
    backend : object
        The backend class the caller chose.

    Returns
    -------
    tuple
        The class handed to the constructor and the class installed afterwards
        (``None``: leave it).

    """
    if not (isinstance(backend, type) and issubclass(backend, FUNCTIONAL_BACKENDS)):
        return backend, None
    stand_in = BackPackGGN if issubclass(backend, BackPackInterface) else CurvlinopsGGN
    return stand_in, backend


def _make_patches() -> list[AttributePatch]:
    init = vars(FunctionalLaplace)["__init__"]
    patches = [
        AttributePatch(
            FunctionalLaplace, "__init__", wrap_init(init, _functional_policy)
        )
    ]
    base = getattr(baselaplace, "BaseFunctionalLaplace", None)  # laplace-torch >= 0.3
    uses_backpack = None if base is None else vars(base).get("_uses_backpack_backend")
    if isinstance(uses_backpack, property):
        patches.append(
            AttributePatch(
                base,
                "_uses_backpack_backend",
                _side_effect_aware(uses_backpack),
            )
        )
    patches.extend(
        factory_patches()
    )  # Laplace(..., functional_approximation="context")
    return patches


def _side_effect_aware(original: property) -> property:
    def _uses_backpack_backend(self: Any) -> bool:
        """Whether the backend extends modules in place with BackPACK."""
        if is_side_effect_free(self._backend_cls):
            return False
        return original.fget(self)  # type: ignore[misc]

    return property(_uses_backpack_backend, doc=original.__doc__)


_REGISTRATION = SharedPatches(_make_patches, max_users=1)


def register() -> bool:
    """Let laplace-torch's estimators accept this package's backends.

    Idempotent; called when :mod:`laplace_diffjac` is imported. Other backends
    behave exactly as before.

    Returns
    -------
    bool
        ``True`` if this call installed the adapter, ``False`` if it already was.

    """
    return _REGISTRATION.acquire()


def unregister() -> bool:
    """Restore laplace-torch exactly as it was before :func:`register`.

    Idempotent. Estimators constructed while registered keep their backend.

    Returns
    -------
    bool
        ``True`` if this call removed the adapter, ``False`` if it was not installed.

    """
    return _REGISTRATION.release()


def is_registered() -> bool:
    """Whether :func:`register` is in effect."""
    return _REGISTRATION.active


__all__ = [
    "FUNCTIONAL_BACKENDS",
    "SIDE_EFFECT_FREE_BACKENDS",
    "is_registered",
    "is_side_effect_free",
    "register",
    "unregister",
]
