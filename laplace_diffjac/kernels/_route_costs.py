"""The work of a Gram route's step, counted, and its time on a device, estimated.

A route (:class:`._budgeted.Route`: the engine's per-layer factors, or assembled
Jacobians) is run on up to eight inputs and on half as many, under a dispatch
mode that
counts what each step of ATen does:

* **kernels**: operators that compute (each a kernel launch on a GPU);
* **views**: operators that only re-describe a tensor (dispatcher time, no
  kernel);
* **multiply-adds** of the matmul-like kernels (PyTorch's own flop formulas,
  :mod:`torch.utils.flop_counter`);
* **bytes** the kernels read and write (every tensor argument and result).

The step is the features, their Gram, and, where a gradient may be asked for,
the backward pass of the Gram's sum of squares. Kernels and views hardly grow with
the batch; multiply-adds and bytes are fitted as ``α b + β b²`` from the two runs.
A device turns the counts into seconds (:class:`DeviceCosts`)::

    seconds = kernels·t_kernel + views·t_view + madds / rate + bytes / bandwidth

Multiply-adds alone choose badly on a GPU: there small models are bound by kernel
launches (the factor route of an 8×8 CNN launches 1.6× the Jacobian route's
kernels for a tenth of its multiply-adds), and wide ones by multiply-adds.
The counts are the same on every device; only the constants differ, and they
are fixed per device kind, so the same call always takes the same route.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._device_arithmetic import float64_at_full_rate
from ._budgeted import Route, batch_of, take_inputs

try:  # private modules of PyTorch: without them, no counts (and no choice)
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry
except ImportError:  # pragma: no cover - torch < 2.1
    COUNTING_AVAILABLE = False
else:
    COUNTING_AVAILABLE = True

__all__ = [
    "COUNTING_AVAILABLE",
    "DeviceCosts",
    "StepWork",
    "Work",
    "count_work",
    "device_costs",
    "step_work",
]


@dataclass(frozen=True)
class Work:
    """What a computation asks of a device.

    Attributes
    ----------
    kernels : int
        Operators that compute (kernel launches on a GPU).
    views : int
        Operators that only make views.
    madds : float
        Multiply-adds of the matmul-like kernels.
    bytes : float
        Bytes the kernels read and write.
    """

    kernels: int
    views: int
    madds: float
    bytes: float


if COUNTING_AVAILABLE:

    class _Counting(TorchDispatchMode):
        """Count every ATen call beneath autograd (forward and backward alike)."""

        def __init__(self) -> None:
            super().__init__()
            self.kernels = 0
            self.views = 0
            self.flops = 0
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func.is_view:
                self.views += 1
                return out
            self.kernels += 1
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                self.flops += formula(*args, **kwargs, out_val=out)
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
            return out


def count_work(fn: Callable[[], Any]) -> Work:
    """Run ``fn()`` and count the work it dispatches.

    Parameters
    ----------
    fn : callable
        Runs the computation; its result is dropped.

    Returns
    -------
    Work
        Kernels, views, multiply-adds (half the counted flops) and bytes.

    Raises
    ------
    RuntimeError
        If this PyTorch has no dispatch modes or flop formulas to count with.
    """
    if not COUNTING_AVAILABLE:  # pragma: no cover - torch < 2.1
        raise RuntimeError("Counting work needs torch >= 2.1.")
    counter = _Counting()
    with counter:
        fn()
    return Work(counter.kernels, counter.views, counter.flops / 2, counter.bytes)


@dataclass(frozen=True)
class DeviceCosts:
    """Seconds per unit of :class:`Work` on one kind of device.

    Attributes
    ----------
    seconds_per_kernel : float
        Launching (dispatching) one computing operator.
    seconds_per_view : float
        Dispatching one view.
    madds_per_second : float
        The matmul rate in the dtype at hand.
    bytes_per_second : float
        Memory bandwidth.
    """

    seconds_per_kernel: float
    seconds_per_view: float
    madds_per_second: float
    bytes_per_second: float

    def seconds(self, work: Work) -> float:
        """The estimated time of ``work``: its four costs added."""
        return (
            work.kernels * self.seconds_per_kernel
            + work.views * self.seconds_per_view
            + work.madds / self.madds_per_second
            + work.bytes / self.bytes_per_second
        )


#: A CPU core, fitted (non-negative least squares) to the time differences of
#: the two routes' ``ntk(x, x)`` + gradient steps on an MLP, an 8×8 CNN and a
#: transformer at B = 1 to 64, float32, one thread (``benchmarks/jacobians/
#: route_costs.py``): 3.6 µs a kernel, 2.0 µs a view, 45 G multiply-adds a second,
#: 12 GB/s.
_CPU_KERNEL_SECONDS = 3.6e-6
_CPU_VIEW_SECONDS = 2.0e-6
_CPU_MADDS_PER_CORE = 4.5e10
_CPU_BYTES_PER_SECOND = 1.2e10

#: A data-centre GPU (A100, H100, H200): eager launches of about 6 µs, float32
#: matmuls (no TF32) at 25 T multiply-adds a second, 2 TB/s. Float64 runs at
#: float32's rate on compute capabilities 8.0, 9.0 and 10.0 (their float64
#: tensor cores), at 1/32 of it on other GPUs.
_GPU_KERNEL_SECONDS = 6e-6
_GPU_VIEW_SECONDS = 2e-6
_GPU_MADDS_PER_SECOND = 2.5e13
_GPU_BYTES_PER_SECOND = 2e12


def device_costs(device: torch.device, dtype: torch.dtype) -> DeviceCosts:
    """The constants that turn counted work into seconds on ``device``.

    Parameters
    ----------
    device : torch.device
        Where the work runs. CPUs use the fitted core constants times
        ``torch.get_num_threads()``; every other device the data-centre GPU's.
    dtype : torch.dtype
        The dtype of the contraction: float64 takes half a CPU core's rate, and
        1/32 of a GPU's where :func:`float64_at_full_rate` is ``False``.

    Returns
    -------
    DeviceCosts
    """
    wide = dtype == torch.float64
    if device.type == "cpu":
        rate = _CPU_MADDS_PER_CORE * torch.get_num_threads() / (2 if wide else 1)
        return DeviceCosts(
            _CPU_KERNEL_SECONDS, _CPU_VIEW_SECONDS, rate, _CPU_BYTES_PER_SECOND
        )
    rate = _GPU_MADDS_PER_SECOND
    if wide and not float64_at_full_rate(device):
        rate /= 32
    return DeviceCosts(
        _GPU_KERNEL_SECONDS, _GPU_VIEW_SECONDS, rate, _GPU_BYTES_PER_SECOND
    )


@dataclass(frozen=True)
class StepWork:
    """A route's step counted at two batch sizes.

    Attributes
    ----------
    small, large : Work
        The symmetric Gram step (features, Gram, backward) of the first
        ``sizes[0]`` and ``sizes[1]`` inputs (``large`` is ``small`` where the
        sizes are equal).
    sizes : tuple of int
        The two batch sizes counted.
    outputs : int
        ``C``, the Gram's last dimension.
    """

    small: Work
    large: Work
    sizes: tuple[int, int]
    outputs: int

    def at(self, b1: int, b2: int, symmetric: bool) -> Work:
        """The work of a ``b1 × b2`` Gram step, from the fitted ``α b + β b²``.

        The features are counted for ``b1`` inputs, and for ``b2`` more unless
        ``symmetric``; the Gram for ``b1 b2`` pairs. Kernels and views are the
        larger run's (they hardly grow with the batch).

        Returns
        -------
        Work
        """
        inputs = b1 if symmetric else b1 + b2
        pairs = b1 * b2
        s1, s2 = self.sizes

        def grown(w1: float, w2: float) -> float:
            if s1 == s2:  # one size counted: all of it per pair
                return w1 / (s1 * s1) * pairs
            beta = max(0.0, (w2 / s2 - w1 / s1) / (s2 - s1))
            alpha = max(0.0, w2 / s2 - beta * s2)
            return alpha * inputs + beta * pairs

        return Work(
            self.large.kernels,
            self.large.views,
            grown(self.small.madds, self.large.madds),
            grown(self.small.bytes, self.large.bytes),
        )


#: The largest batch a route's step is counted on (and half of it): large
#: enough that the per-parameter choices of :mod:`._factor_gram`, which depend
#: on the batch, are those of real batches (counted on one and two inputs, a
#: transformer's bytes came out 4.6× too high at B = 64).
COUNTED_BATCH = 8


def step_work(
    route: Route,
    x: Any,
    prior_var: torch.Tensor,
    grad: bool,
    diagonal: bool = False,
    largest: int = COUNTED_BATCH,
) -> StepWork:
    """Count ``route``'s Gram step on the first ``b`` and ``b // 2`` inputs of ``x``.

    ``b`` is the smallest of ``x``'s batch, ``largest`` and
    :data:`COUNTED_BATCH`. The smaller run goes first, so that the larger one's
    kernels and views are those of a warm call. The gradient, where ``grad``,
    is taken with respect to the inputs when they require one, else the
    parameters that do, as :func:`torch.autograd.grad` (nothing is written to
    any ``.grad``).

    Parameters
    ----------
    route : Route
        Features and their pair contraction.
    x : torch.Tensor or mapping
        A batch.
    prior_var : torch.Tensor
        ``()`` or ``(P,)``.
    grad : bool
        Whether the step includes the backward pass.
    diagonal : bool, default=False
        Count the per-input blocks (``ntk_diag``'s step) instead of the Gram;
        their work then fits as ``α b`` (``β`` comes out as zero).
    largest : int, default=COUNTED_BATCH
        The most inputs counted at once (what the memory budget lets a chunk
        hold).

    Returns
    -------
    StepWork
    """
    outputs = [0]

    def step(xs: Any) -> None:
        leaves = list(xs.values()) if isinstance(xs, Mapping) else [xs]
        with torch.set_grad_enabled(grad):
            feats = route.features(xs)
            K = route.pair(feats, None if diagonal else feats, prior_var)
            outputs[0] = int(K.shape[-1])
            if grad:
                wrt = [t for t in leaves if t.requires_grad]
                wrt = wrt or [p for p in route.params if p.requires_grad]
                if K.requires_grad and wrt:
                    torch.autograd.grad(K, wrt, torch.ones_like(K), allow_unused=True)

    def counted(b: int) -> Work:
        xs = _leaves(take_inputs(x, slice(0, b)))
        return count_work(lambda: step(xs))

    s2 = max(1, min(batch_of(x), largest, COUNTED_BATCH))
    s1 = max(1, s2 // 2)
    small = counted(s1)
    large = counted(s2) if s2 > s1 else small
    return StepWork(small, large, (s1, s2), outputs[0])


def _leaves(x: Any) -> Any:
    """Fresh leaves of the floating inputs, requiring grad as the caller's do."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(t.requires_grad and t.is_floating_point())

    if isinstance(x, Mapping):
        return type(x)({k: leaf(v) for k, v in x.items()})  # type: ignore[call-arg]
    return leaf(x)
