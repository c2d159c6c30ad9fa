"""Per-sample Jacobians in chunks of the batch, under a memory budget.

A batch's Jacobians ``(B, C, P)`` take ``B * C * P * itemsize`` bytes; with many
outputs (a video or language model's C) or parameters, that alone can exceed the
memory of the machine. The backends therefore compute them ``b`` samples at a
time, with ``b * C * P * itemsize <= budget``: the dense curvature (``full``) is
accumulated chunk by chunk, so no more than the budget of Jacobians is held at
once; a method that returns all Jacobians concatenates the chunks (it bounds the
engine's intermediate memory, not the returned tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import InvalidInputError

__all__ = [
    "DEFAULT_JACOBIAN_BUDGET",
    "ChunkedCurvature",
    "batch_slices",
    "check_budget",
    "concatenate_chunks",
    "samples_per_chunk",
]

#: Default budget for one chunk of Jacobians: 1 GiB.
DEFAULT_JACOBIAN_BUDGET: int = 2**30


def check_budget(budget: object) -> int:
    """``budget`` as a positive number of bytes, or a clear error."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InvalidInputError(
            f"jacobian_budget must be a positive int (bytes); got {budget!r}."
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
    if step >= x.shape[0]:
        return compute(x)
    parts = [compute(x[s]) for s in batch_slices(x.shape[0], step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class ChunkedCurvature:
    """``full`` over chunks of the batch; mixed in before laplace-torch's backend.

    Needs ``model``, ``params``, ``last_layer`` and ``jacobian_budget`` (bytes) of
    the backend; ``_jacobian_rows`` is ``None`` for Jacobians (one row per
    output) or 1 for per-sample gradients (the empirical Fisher).
    """

    model: Any
    params: list[torch.Tensor]
    last_layer: bool
    jacobian_budget: int
    _jacobian_rows: int | None = None

    def _chunk(self, x: Any, width: int | None, n_params: int) -> int:
        """Samples per chunk of ``x`` (all of them for dict-like batches)."""
        if not isinstance(x, torch.Tensor) or n_params == 0:
            return 1 << 62
        if width is None:  # outputs: set by laplace-torch's fit, else one forward
            width = getattr(self.model, "output_size", None)
            if not isinstance(width, int):
                with torch.no_grad():
                    width = int(self.model(x[:1]).shape[-1])
        itemsize = self.params[0].element_size() if self.params else 8
        return samples_per_chunk(
            x.shape[0], width, n_params, itemsize, self.jacobian_budget
        )

    def _n_params(self, last_layer: bool) -> int:
        """Columns of the Jacobians (0 if the last layer is not known yet)."""
        if not last_layer:
            return sum(p.numel() for p in self.params)
        layer = getattr(self.model, "last_layer", None)
        return 0 if layer is None else sum(p.numel() for p in layer.parameters())

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
        step = self._chunk(x, self._jacobian_rows, self._n_params(self.last_layer))
        if step >= len(y):
            return super().full(x, y, **kwargs)  # type: ignore[misc]
        loss: Any = 0.0
        H: Any = 0.0
        for part in batch_slices(len(y), step):
            loss_part, H_part = super().full(x[part], y[part], **kwargs)  # type: ignore[misc]
            loss, H = loss + loss_part, H + H_part
        return loss, H
