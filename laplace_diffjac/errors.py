"""Exceptions raised by ``laplace_diffjac`` with messages that name the fix."""

from __future__ import annotations


class UnsupportedModuleError(TypeError):
    """A module in the model has no per-sample Jacobian rule in this backend.

    Raised before anything on the model is touched, so the model is left exactly
    as it was.
    """


class InvalidInputError(ValueError):
    """The input batch cannot be used with this backend or model."""


class MemoryBudgetError(MemoryError):
    """A request does not fit the working-memory budget even in its smallest chunk.

    Raised before any chunk is computed (:mod:`laplace_diffjac.budget`); the message
    names the budget, what the request needs and what would fit.
    """
