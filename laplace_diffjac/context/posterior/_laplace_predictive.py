"""laplace-torch's predictive interface (``la(x)``, ``predictive_samples``).

The link approximations, sampling and the checks of ``pred_type`` on top of one
method a posterior provides, ``_glm_predictive_distribution`` (the latent mean
and covariance), as laplace-torch's ``BaseLaplace`` does.
"""

from __future__ import annotations

import torch

from ._predictive import gaussian_samples, link_probabilities

__all__ = ["LaplacePredictive"]


class LaplacePredictive:
    """``__call__`` and ``predictive_samples`` from the latent predictive.

    Attributes
    ----------
    likelihood : str
        ``'regression'`` or ``'classification'``.

    """

    likelihood: str

    def _glm_predictive_distribution(
        self, x: torch.Tensor, joint: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent mean ``(B*, C)`` and covariance (per input, or joint)."""
        raise NotImplementedError

    def __call__(
        self,
        x: torch.Tensor,
        pred_type: str = "glm",
        joint: bool = False,
        link_approx: str = "probit",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Posterior predictive, as laplace-torch's ``la(x, pred_type='glm')``.

        Parameters
        ----------
        x : torch.Tensor
            Test inputs ``(B*, *input_shape)``.
        pred_type : {'glm', 'gp'}, default='glm'
            Both mean the linearised (GP) predictive.
        joint : bool, default=False
            Regression: return the joint ``(B* C,)`` mean and ``(B* C, B* C)``
            covariance.
        link_approx : {'probit', 'mc', 'bridge', 'bridge_norm'}, default='probit'
            Classification link approximation.
        n_samples : int, default=100
            Samples for ``link_approx='mc'``.
        diagonal_output : bool, default=False
            Regression: return variances ``(B*, C)`` instead of ``(B*, C, C)``;
            ``'mc'``: sample with a diagonal covariance.
        generator : torch.Generator, optional
            Random generator for ``'mc'``.
        fitting : bool, default=False
            Accepted for laplace-torch's ``validate``; no effect.

        Returns
        -------
        torch.Tensor or tuple of torch.Tensor
            Regression: ``(mean (B*, C), var (B*, C, C))`` without observation
            noise (add ``sigma_noise**2`` for the predictive of ``y``).
            Classification: probabilities ``(B*, C)``.

        Raises
        ------
        ValueError
            For an unsupported ``pred_type`` or ``link_approx``.

        """
        if pred_type not in ("glm", "gp"):
            raise ValueError(f"pred_type must be 'glm' or 'gp', got {pred_type!r}.")
        regression = self.likelihood == "regression"
        f_mu, f_var = self._glm_predictive_distribution(x, joint=joint and regression)
        if regression:
            if diagonal_output and not joint:
                f_var = f_var.diagonal(dim1=-2, dim2=-1)
            return f_mu, f_var
        return link_probabilities(
            f_mu, f_var, link_approx, n_samples, diagonal_output, generator
        )

    def predictive_samples(
        self,
        x: torch.Tensor,
        pred_type: str = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Samples of the predictive (softmax applied for classification).

        Parameters
        ----------
        x : torch.Tensor
            ``(B*, *input_shape)``.
        pred_type : {'glm', 'gp'}, default='glm'
            As laplace-torch's; both mean the linearised predictive.
        n_samples : int, default=100
            Number of samples.
        diagonal_output : bool, default=False
            Sample with diagonal output covariance.
        generator : torch.Generator, optional
            Random generator.

        Returns
        -------
        torch.Tensor
            ``(n_samples, B*, C)``.

        Raises
        ------
        ValueError
            For an unsupported ``pred_type``.

        """
        if pred_type not in ("glm", "gp"):
            raise ValueError(f"pred_type must be 'glm' or 'gp', got {pred_type!r}.")
        f_mu, f_var = self._glm_predictive_distribution(x)
        samples = gaussian_samples(f_mu, f_var, n_samples, diagonal_output, generator)
        return samples if self.likelihood == "regression" else samples.softmax(-1)
