"""The laplace-torch class handed to laplace-torch's constructors in place of ours."""

from __future__ import annotations

from laplace.curvature import CurvlinopsGGN

__all__ = ["upstream_stand_in"]


def upstream_stand_in(backend: type) -> type:
    """The laplace-torch backend class that stands in for ``backend`` at construction.

    laplace-torch's constructors check the backend *class* and otherwise only store
    it: ``FunctionalLaplace`` asserts it is one of ``BackPackGGN``, ``AsdlGGN``,
    ``CurvlinopsGGN``, and ``BaseLaplace`` refuses BackPACK-like backends when some
    parameters are frozen. ``CurvlinopsGGN`` passes both checks in laplace-torch
    0.2.3 and 0.3; the caller installs ``backend`` as ``_backend_cls`` right after
    the constructor returns (the instance is built lazily, on first use). Used by
    the adapter (:mod:`laplace_diffjac.laplace_integration`) and by
    :class:`~laplace_diffjac.laplace_integration.LocationFunctionalLaplace`, so
    the trick lives in one place.

    Parameters
    ----------
    backend : type
        One of this package's backend classes (or a subclass).

    Returns
    -------
    type
        ``CurvlinopsGGN``.

    """
    del backend  # the same stand-in serves every backend of ours
    return CurvlinopsGGN
