"""The latent predictive: its covariance, link approximations and sampling."""

from __future__ import annotations

import math

import torch

from ...errors import InvalidInputError

__all__ = [
    "gaussian_samples",
    "latent_covariance",
    "laplace_bridge",
    "link_probabilities",
    "probit",
    "q_batch_shape",
]

LINKS = ("probit", "mc", "bridge", "bridge_norm")


def latent_covariance(
    K_ss: torch.Tensor, V: torch.Tensor, W: torch.Tensor | None = None
) -> torch.Tensor:
    """``K** − V Vᵀ + W Wᵀ`` per block of test outputs, in float64.

    Parameters
    ----------
    K_ss : torch.Tensor
        ``(n, w, w)`` prior Grams of ``n`` blocks of ``w`` test outputs each
        (``w = C`` per input, or ``q C`` for the joint covariance of ``q`` inputs,
        input-major).
    V : torch.Tensor
        ``(n w, MC)``, the projected cross term of all test outputs in order.
    W : torch.Tensor, optional
        ``(n w, MC)``, the part of ``V Vᵀ`` the posterior keeps
        (:meth:`._factor_cache.PredictiveFactor.project`).

    Returns
    -------
    torch.Tensor
        ``(n, w, w)``.

    """
    V = V.reshape(*K_ss.shape[:2], -1)
    covariance = K_ss.to(torch.float64) - V @ V.transpose(1, 2)
    if W is None:
        return covariance
    W = W.reshape(*K_ss.shape[:2], -1)
    return covariance + W @ W.transpose(1, 2)


def q_batch_shape(x: torch.Tensor, feature_shape: torch.Size) -> torch.Size:
    """The leading ``(*batch, q)`` of BoTorch-style inputs ``(*batch, q, *features)``.

    Returns
    -------
    torch.Size

    Raises
    ------
    InvalidInputError
        For inputs without a ``q`` axis in front of ``feature_shape``.

    """
    feature_dims = len(feature_shape)
    lead = x.shape[: x.dim() - feature_dims]
    if not lead or x.shape[x.dim() - feature_dims :] != feature_shape:
        raise InvalidInputError(
            f"x has shape {tuple(x.shape)}; expected (*batch, q, "
            f"{', '.join(map(str, feature_shape))}) like the locations."
        )
    return lead


def gaussian_samples(
    f_mu: torch.Tensor,
    f_var: torch.Tensor,
    n_samples: int,
    diagonal_output: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Samples ``(n_samples, B*, C)`` of ``N(f_mu, f_var)`` (per input).

    Parameters
    ----------
    f_mu : torch.Tensor
        ``(B*, C)``.
    f_var : torch.Tensor
        ``(B*, C, C)``.
    n_samples : int
        Number of samples.
    diagonal_output : bool
        Ignore the off-diagonal covariances.
    generator : torch.Generator or None
        Random generator.

    Returns
    -------
    torch.Tensor
        ``(n_samples, B*, C)``.

    """
    if diagonal_output:
        f_var = torch.diag_embed(f_var.diagonal(dim1=-2, dim2=-1))
    C = f_mu.shape[-1]
    eye = torch.eye(C, dtype=torch.float64, device=f_mu.device)
    var = f_var.to(torch.float64)
    scale = 1e-10 * var.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    L = torch.linalg.cholesky(var + scale[:, None, None] * eye).to(f_mu.dtype)
    eps = torch.randn(
        (n_samples, *f_mu.shape),
        generator=generator,
        device=f_mu.device,
        dtype=f_mu.dtype,
    )
    return f_mu + torch.einsum("bce,sbe->sbc", L, eps)


def probit(f_mu: torch.Tensor, f_var: torch.Tensor) -> torch.Tensor:
    """Probit approximation of ``E[softmax(f)]``, ``(B*, C)`` from ``(B*, C, C)``."""
    kappa = 1 / torch.sqrt(1.0 + math.pi / 8 * f_var.diagonal(dim1=1, dim2=2))
    return torch.softmax(kappa * f_mu, dim=-1)


def laplace_bridge(
    f_mu: torch.Tensor, f_var: torch.Tensor, normalise: bool
) -> torch.Tensor:
    """Laplace bridge, as laplace-torch's ``link_approx='bridge'``/``'bridge_norm'``."""
    f_mu = f_mu - (
        f_var.sum(-1)
        * f_mu.sum(-1).reshape(-1, 1)
        / f_var.sum(dim=(1, 2)).reshape(-1, 1)
    )
    f_var = f_var - torch.einsum(
        "bi,bj->bij", f_var.sum(-1), f_var.sum(-2)
    ) / f_var.sum(dim=(1, 2)).reshape(-1, 1, 1)
    K = f_mu.shape[-1]
    f_var_diag = torch.diagonal(f_var, dim1=1, dim2=2)
    if normalise:
        mean_var = f_var_diag.mean(dim=1) / math.sqrt(K / 2)
        f_mu = f_mu / mean_var.sqrt().unsqueeze(-1)
        f_var_diag = f_var_diag / mean_var.unsqueeze(-1)
    sum_exp = torch.exp(-f_mu).sum(dim=1).unsqueeze(-1)
    alpha = (1 - 2 / K + f_mu.exp() / K**2 * sum_exp) / f_var_diag
    return torch.nan_to_num(alpha / alpha.sum(dim=1).unsqueeze(-1), nan=1.0)


def link_probabilities(
    f_mu: torch.Tensor,
    f_var: torch.Tensor,
    link_approx: str,
    n_samples: int,
    diagonal_output: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Class probabilities ``(B*, C)`` under a laplace-torch link approximation.

    Parameters
    ----------
    f_mu : torch.Tensor
        ``(B*, C)`` latent mean.
    f_var : torch.Tensor
        ``(B*, C, C)`` latent covariance.
    link_approx : {'probit', 'mc', 'bridge', 'bridge_norm'}
        The approximation.
    n_samples : int
        Samples for ``'mc'``.
    diagonal_output : bool
        ``'mc'``: sample with a diagonal covariance.
    generator : torch.Generator or None
        ``'mc'``: random generator.

    Returns
    -------
    torch.Tensor
        ``(B*, C)``.

    Raises
    ------
    ValueError
        For another ``link_approx``.

    """
    if link_approx not in LINKS:
        raise ValueError(f"link_approx must be one of {LINKS}, got {link_approx!r}.")
    if link_approx == "mc":
        samples = gaussian_samples(f_mu, f_var, n_samples, diagonal_output, generator)
        return samples.softmax(dim=-1).mean(dim=0)
    if link_approx == "probit":
        return probit(f_mu, f_var)
    return laplace_bridge(f_mu, f_var, normalise=link_approx == "bridge_norm")
