"""Per-sample Jacobians in chunks of the batch, under a memory budget.

A batch's Jacobians ``(B, C, P)`` take ``B * C * P * itemsize`` bytes; with many
outputs (a video or language model's C) or parameters, that alone can exceed the
memory of the machine. The backends therefore compute them ``b`` samples at a
time, with ``b * C * P * itemsize <= budget``: the dense curvature (``full``) is
accumulated chunk by chunk, so no more than the budget of Jacobians is held at
once; a method that returns all Jacobians concatenates the chunks (it bounds the
engine's intermediate memory, not the returned tensor).

The budget is the backend's ``jacobian_budget`` where one is given, else half
the package's memory budget in force at the call
(:func:`laplace_diffjac.budget.get_memory_budget`: 1 GiB of Jacobians at the
CPU's default 2 GiB), the other half left to the engine's working memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..budget import format_bytes, get_memory_budget, over_budget
from ..errors import InvalidInputError, MemoryBudgetError

__all__ = [
    "DEFAULT_JACOBIAN_BUDGET",
    "ChunkedCurvature",
    "batch_slices",
    "check_budget",
    "concatenate_chunks",
    "samples_per_chunk",
]

#: Default ``jacobian_budget``: ``None``, half the memory budget in force.
DEFAULT_JACOBIAN_BUDGET: int | None = None

#: The share of the memory budget that one chunk of Jacobians may take.
JACOBIAN_SHARE = 0.5


def check_budget(budget: object) -> int | None:
    """``budget`` as a positive number of bytes or ``None``, or a clear error."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InvalidInputError(
            "jacobian_budget must be a positive int (bytes) or None (half the "
            f"memory budget, laplace_diffjac.set_memory_budget); got {budget!r}."
        )
    return budget


def samples_per_chunk(
    batch: int, width: int, n_params: int, itemsize: int, budget: int
) -> int:
    """How many samples' Jacobians fit in ``budget`` bytes.

    Parameters
    ----------
    batch : int
        Samples in the batch.
    width : int
        Rows per sample (outputs ``C`` for Jacobians, 1 for gradients).
    n_params : int
        Columns ``P``.
    itemsize : int
        Bytes per element.
    budget : int
        The backend's ``jacobian_budget`` in bytes.

    Returns
    -------
    int
        ``b`` with ``b * width * n_params * itemsize <= budget``, at most ``batch``.

    Raises
    ------
    InvalidInputError
        If a single sample exceeds the budget.

    """
    per_sample = width * n_params * itemsize
    if per_sample > budget:
        raise InvalidInputError(
            f"one sample's Jacobian takes {per_sample} bytes ({width} outputs x "
            f"{n_params} parameters x {itemsize} bytes), more than the backend's "
            f"jacobian_budget of {budget} bytes. Raise it (backend_kwargs="
            "{'jacobian_budget': bytes}), or use a structure that needs no dense "
            "Jacobians (hessian_structure='diag'/'kron', last-layer or subnetwork "
            "Laplace)."
        )
    return max(1, min(batch, budget // per_sample))


def batch_slices(batch: int, step: int) -> Iterator[slice]:
    """Consecutive slices of ``range(batch)`` of length ``step`` (the last shorter)."""
    for start in range(0, batch, step):
        yield slice(start, min(start + step, batch))


def concatenate_chunks(
    compute: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute(x)`` evaluated ``step`` samples at a time, concatenated.

    Parameters
    ----------
    compute : callable
        ``compute(x_chunk) -> (Js_chunk, f_chunk)``, batch first.
    x : torch.Tensor
        ``(B, *input_shape)``.
    step : int
        Samples per chunk.

    Returns
    -------
    tuple of torch.Tensor
        ``(Js, f)`` as ``compute(x)`` would return them.

    """
    if not isinstance(x, torch.Tensor) or step >= x.shape[0]:
        return compute(x)
    parts = [compute(x[s]) for s in batch_slices(x.shape[0], step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class ChunkedCurvature:
    """``full`` over chunks of the batch; mixed in before laplace-torch's backend.

    Needs ``model``, ``params``, ``last_layer`` and ``jacobian_budget`` (bytes,
    or ``None`` for half the memory budget in force) of the backend;
    ``_jacobian_rows`` is ``None`` for Jacobians (one row per output) or 1 for
    per-sample gradients (the empirical Fisher).
    """

    model: Any
    params: list[torch.Tensor]
    last_layer: bool
    jacobian_budget: int | None
    _jacobian_rows: int | None = None

    def _check_input(self, x: Any) -> None:
        """Refuse a bad batch before any computation (the backend's own check)."""

    def _outputs(self) -> int | None:
        """Outputs per sample, ``None`` if unknown.

        Returns
        -------
        int or None
            laplace-torch's ``model.output_size``, else the number seen in this
            backend's last Jacobians.

        """
        width = getattr(self.model, "output_size", None)
        if isinstance(width, int):
            return width
        return getattr(self, "_outputs_seen", None)

    def _step(self, batch: int, width: int, n_params: int) -> int:
        itemsize = self.params[0].element_size() if self.params else 8
        if self.jacobian_budget is not None:
            budget = self.jacobian_budget
            return samples_per_chunk(batch, width, n_params, itemsize, budget)
        device = self.params[0].device if self.params else None
        whole_budget = get_memory_budget(device)
        budget = int(whole_budget * JACOBIAN_SHARE)
        per_sample = width * n_params * itemsize
        if per_sample > budget:
            raise MemoryBudgetError(
                over_budget(
                    "per-sample Jacobians",
                    int(per_sample / JACOBIAN_SHARE),
                    whole_budget,
                    f"One sample's Jacobian takes {format_bytes(per_sample)} "
                    f"({width} outputs × {n_params} parameters × {itemsize} "
                    "bytes), half the budget at most; structures that need no "
                    "dense Jacobians (hessian_structure='diag'/'kron', last-layer "
                    "or subnetwork Laplace) fit.",
                )
            )
        return samples_per_chunk(batch, width, n_params, itemsize, budget)

    def _n_params(self, last_layer: bool) -> int:
        """Columns of the Jacobians (0 if the last layer is not known yet)."""
        if not last_layer:
            return sum(p.numel() for p in self.params)
        layer = getattr(self.model, "last_layer", None)
        return 0 if layer is None else sum(p.numel() for p in layer.parameters())

    def _chunked_jacobians(
        self,
        compute: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
        x: Any,
        last_layer: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``compute(x) -> (Js, f)`` in chunks of at most ``jacobian_budget`` bytes.

        With the outputs unknown (a backend used outside laplace-torch's fit),
        the first sample's Jacobians are computed alone and give them.

        Returns
        -------
        tuple of torch.Tensor
            ``(Js, f)`` as ``compute(x)`` would return them.

        """
        n_params = self._n_params(last_layer)
        if not isinstance(x, torch.Tensor) or n_params == 0:
            return compute(x)
        width = self._outputs()
        if width is not None:
            return concatenate_chunks(compute, x, self._step(len(x), width, n_params))
        first = compute(x[:1])
        self._outputs_seen = int(first[0].shape[1])
        step = self._step(len(x), self._outputs_seen, n_params)
        if len(x) == 1:
            return first
        rest = concatenate_chunks(compute, x[1:], step)
        return torch.cat([first[0], rest[0]]), torch.cat([first[1], rest[1]])

    def full(
        self, x: torch.Tensor, y: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """laplace-torch's dense curvature, summed over chunks of the batch.

        Each chunk's Jacobians (or gradients) take at most ``jacobian_budget``
        bytes; the sum equals the one-chunk result up to rounding (with
        ``stochastic=True`` the Monte-Carlo draws are made chunk by chunk).

        Parameters
        ----------
        x : torch.Tensor
            ``(batch, *input_shape)``.
        y : torch.Tensor
            Targets ``(batch, ...)``.
        **kwargs
            Passed on to laplace-torch.

        Returns
        -------
        loss : torch.Tensor
        H : torch.Tensor
            ``(parameters, parameters)``.

        """
        n_params = self._n_params(self.last_layer)
        if not isinstance(x, torch.Tensor) or n_params == 0:
            return super().full(x, y, **kwargs)  # type: ignore[misc]
        self._check_input(x)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        width = self._jacobian_rows or self._outputs()
        if width is None:  # learn the outputs from the first sample alone
            parts.append(super().full(x[:1], y[:1], **kwargs))  # type: ignore[misc]
            width = self._outputs()
        start = len(parts)
        step = self._step(len(y), width or 1, n_params)
        for part in batch_slices(len(y) - start, step):
            part = slice(part.start + start, part.stop + start)
            parts.append(super().full(x[part], y[part], **kwargs))  # type: ignore[misc]
        if len(parts) == 1:
            return parts[0]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)  # type: ignore[return-value]
