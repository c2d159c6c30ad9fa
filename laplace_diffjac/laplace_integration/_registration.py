"""Make every laplace-torch estimator accept this package's backends.

laplace-torch restricts backends in three ways that matter here:

* ``FunctionalLaplace.__init__`` (hence ``FunctionalLLLaplace`` and
  ``Laplace(..., hessian_structure='gp')``) runs
  ``assert backend in [BackPackGGN, AsdlGGN, CurvlinopsGGN]``, which rejects
  ``DiffBackPackGGN`` and ``DiffFuncGGN``.
* In laplace-torch 0.3, ``BaseFunctionalLaplace._uses_backpack_backend``
  (``issubclass(backend, BackPackInterface)``) keeps ELLA and VaLLA off
  ``torch.func`` because BackPACK extends modules in place. The
  ``DiffBackPack*`` backends are BackPACK subclasses that never do, so for them
  the property is ``False``.
* ``BaseLaplace.__init__`` raises "If some grad are switched off, the BackPACK and
  Asdfghjkl backends are not supported" when some parameters have
  ``requires_grad=False`` (0.3: ``issubclass(backend, (BackPackInterface,
  AsdfghjklInterface))``; 0.2.3: ``"backpack" in backend.__name__.lower()``, which
  also catches ``DiffBackPackGGN``). BackPACK's ``extend`` would see the frozen
  parameters; this package's backends take Jacobians and curvature over
  ``backend.params`` only, so for them the check is skipped: the constructor is
  handed ``CurvlinopsGGN`` (which it only stores) and ours is installed as
  ``_backend_cls`` before any subclass code reads it.

:func:`register` replaces exactly these class attributes (the second only where it
exists) and :func:`unregister` puts the originals back. Everything else is left
as laplace-torch has it, on purpose:

* ``ParametricLaplace.fit`` refuses dict-like batches for backends named
  "backpack"; ``DiffBackPackGGN``/``DiffBackPackEF`` take them, so for those
  ``fit`` runs past that check (:mod:`._dict_batches`);
* the refusal of frozen parameters is kept for laplace-torch's own BackPACK and
  ASDL backends;
* ``FunctionalLaplace`` stays a GGN method: ``DiffBackPackEF`` is rejected there
  exactly as ``BackPackEF`` is.

The decisions are made with ``issubclass``, never with class names.
"""

from __future__ import annotations

from typing import Any

from laplace import baselaplace
from laplace.baselaplace import BaseLaplace, FunctionalLaplace, ParametricLaplace

from ..backends import (
    DiffBackPackEF,
    DiffBackPackGGN,
    DiffFuncGGN,
    upstream_stand_in,
)
from ._backend_args import wrap_init
from ._dict_batches import dict_batch_fit
from ._distributed_fit import distributed_fit_patches
from ._distributed_tuning import tuning_patches
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


def is_side_effect_free(backend: object) -> bool:
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


def _functional_policy(backend: object) -> tuple[object, type | None]:
    """Let ``FunctionalLaplace`` take our GGN backends past its allow-list.

    The constructor is given ``CurvlinopsGGN``, which its allow-list accepts and
    whose only other use there is the frozen-parameter check that
    :func:`_frozen_parameters_policy` lifts for ours; ours is installed once it
    returns.

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
    return upstream_stand_in(backend), backend


def _frozen_parameters_policy(backend: object) -> tuple[object, type | None]:
    """Let ``BaseLaplace.__init__`` take our backends when parameters are frozen.

    ``BaseLaplace.__init__`` uses ``backend`` for that check and to store it; it is
    given ``CurvlinopsGGN`` and ours is stored as ``_backend_cls`` once it returns.

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
    if isinstance(backend, type) and is_side_effect_free(backend):
        return upstream_stand_in(backend), backend
    return backend, None


def _make_patches() -> list[AttributePatch]:
    base_init = vars(BaseLaplace)["__init__"]
    init = vars(FunctionalLaplace)["__init__"]
    patches = [
        AttributePatch(
            BaseLaplace, "__init__", wrap_init(base_init, _frozen_parameters_policy)
        ),
        AttributePatch(
            FunctionalLaplace, "__init__", wrap_init(init, _functional_policy)
        ),
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
    # Laplace(..., functional_approximation="context") builds a ContextPosterior.
    patches.extend(factory_patches())
    # Under torch.distributed: fit over the ranks' shards (or refuse), grid search
    # over validation shards, marglik_training refused.
    # Dict-like batches for the DiffBackPack backends, past laplace-torch's
    # class-name check in ParametricLaplace.fit.
    patches.extend(distributed_fit_patches(_uses_ours, _dict_batches))
    patches.extend(tuning_patches(_uses_ours, _backend_is_ours))
    return patches


def _dict_batches(owner: type, fit: Any) -> Any:
    """``ParametricLaplace.fit`` lets dict-like batches reach our backends."""
    return dict_batch_fit(fit) if owner is ParametricLaplace else fit


def _uses_ours(estimator: Any) -> bool:
    """Whether an estimator's backend class is one of ours."""
    return is_side_effect_free(getattr(estimator, "_backend_cls", None))


def _backend_is_ours(backend: object) -> bool:
    """Whether ``backend`` is ours, or becomes ours in ``BaseLaplace.__init__``.

    An active :func:`~laplace_diffjac.patch_laplace` wraps that constructor with a
    policy that swaps laplace-torch's BackPACK backends for ours; the wrapper's
    ``backend_policy`` says what a backend becomes (no import of the drop-in,
    which imports this module).

    Returns
    -------
    bool
    """
    if is_side_effect_free(backend):
        return True
    policy = getattr(vars(BaseLaplace)["__init__"], "backend_policy", None)
    return policy is not None and is_side_effect_free(policy(backend)[0])


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

    Raises
    ------
    RuntimeError
        If a patch made after :func:`register` (an active
        :func:`~laplace_diffjac.patch_laplace`) still wraps the same constructor;
        nothing is changed then.

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
