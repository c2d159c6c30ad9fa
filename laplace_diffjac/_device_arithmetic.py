"""What the package assumes of a device's arithmetic, read off the device itself.

Two choices depend on how fast a device runs float64 matmuls against float32:
the route :func:`laplace_diffjac.ntk` takes (:mod:`.kernels._route_costs`) and the
dtype :class:`laplace_diffjac.ContextPosterior` computes in by default. A CPU's
vector units run float64 at half float32's rate, and so do the float64 tensor
cores of NVIDIA's data-centre GPUs (compute capabilities 8.0: A100, 9.0: H100,
H200, 10.0: B200); other GPUs run it at 1/32 to 1/64.
"""

from __future__ import annotations

import torch

__all__ = ["default_compute_dtype", "float64_at_full_rate"]

#: CUDA compute capabilities whose float64 matmuls run near float32's rate.
FULL_RATE_FLOAT64 = frozenset({(8, 0), (9, 0), (10, 0)})


def float64_at_full_rate(device: torch.device) -> bool:
    """Whether float64 matmuls run near float32's rate on ``device``.

    Parameters
    ----------
    device : torch.device
        A CPU (``True``), a CUDA device (``True`` for compute capabilities 8.0,
        9.0 and 10.0) or another accelerator (``False``).

    Returns
    -------
    bool
    """
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) in FULL_RATE_FLOAT64
    return False


def default_compute_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype a context posterior computes in by default on ``device``.

    Float64 where it runs near float32's rate; elsewhere the model's own dtype
    (``None``): there float64 costs 30–60× the time, and float32's error on a
    CIFAR ResNet (M = 64: the predictive variance 2.4·10⁻⁵, the evidence
    4·10⁻⁷ relative to float64's, ``benchmarks/context_posterior``) is the
    smaller price.

    Parameters
    ----------
    device : torch.device
        Where the model's parameters are.

    Returns
    -------
    torch.dtype or None
        ``torch.float64``, or ``None`` for the model's dtype.
    """
    return torch.float64 if float64_at_full_rate(device) else None
