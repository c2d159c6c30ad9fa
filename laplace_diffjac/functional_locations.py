"""laplace-torch's ``FunctionalLaplace`` with given context locations.

``FunctionalLaplace.fit`` draws ``n_subset`` training points at random
(``_get_SoD_data_loader``) and uses them for everything: the kernel ``K_MM``, the
likelihood Hessians ``Λ_MM`` (from the MAP outputs there, not the targets) and,
only for the marginal likelihood, the targets ``y``. The linearised predictive
needs no targets: its mean is the MAP network and its covariance
``K** − K*M (K_MM + Λ_MM⁻¹)⁻¹ K_M*`` depends on the inputs only.

:class:`LocationFunctionalLaplace` overrides that one hook: the subset loader yields
the given locations with pseudo-targets, the MAP predictions ``f(Z)`` (regression)
or their arg-max classes (classification). ``fit`` still receives the real training
loader, so ``n_data = N`` and laplace-torch's subset-of-data prior scaling
``M / N`` is the same as for a random subset: with the locations set to the subset
``FunctionalLaplace`` would draw, the two posteriors are identical (tested).

The marginal likelihood (``log_marginal_likelihood``, prior optimisation by
``'marglik'``) then refers to the pseudo-targets and is not the data's.
"""

from __future__ import annotations

from typing import Any

import torch
from laplace import FunctionalLaplace
from laplace.curvature import BackPackGGN
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .backends import DiffBackPackGGN

__all__ = ["LocationFunctionalLaplace", "functional_laplace_on_locations"]


class LocationFunctionalLaplace(FunctionalLaplace):
    """``FunctionalLaplace`` whose subset-of-data points are given locations.

    Parameters
    ----------
    model : torch.nn.Module
        Trained network.
    likelihood : {'regression', 'classification'}
        The likelihood.
    locations : torch.Tensor
        Context locations ``(M, *input_shape)``; ``n_subset = M``.
    backend : type, default=DiffBackPackGGN
        Curvature backend class (any class with laplace-torch's ``jacobians``;
        laplace-torch's own check only admits its three built-in classes).
    reweight : bool, default=False
        ``False``: laplace-torch's subset-of-data scaling (kernel times ``M / N``),
        as for a random subset. ``True``: each location stands for ``N / M``
        training points, i.e. the kernel is not scaled and the likelihood
        Hessians at the locations are multiplied by ``N / M``; in the weight-space
        view the posterior precision is ``δ I + (N / M) Σ_m J_mᵀ Λ_m J_m``, which
        approximates the full-data ``δ I + Σ_n J_nᵀ Λ_n J_n`` when the locations
        represent the data.
    **kwargs
        Passed to ``FunctionalLaplace`` (``sigma_noise``, ``prior_precision``,
        ``temperature``, ``enable_backprop``, ``independent_outputs``, ...).

    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        locations: torch.Tensor,
        backend: type = DiffBackPackGGN,
        reweight: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("n_subset", None)
        super().__init__(
            model,
            likelihood,
            n_subset=locations.shape[0],
            backend=BackPackGGN,
            **kwargs,
        )
        self._backend_cls = backend  # the backend is built lazily, on first use
        self._backend = None
        self.locations = locations.detach()
        self.reweight = reweight

    def fit(self, train_loader: DataLoader, progress_bar: bool = False) -> None:
        """Fit on the locations; ``train_loader`` sets ``N`` (and the batch size).

        Parameters
        ----------
        train_loader : DataLoader
            The training loader; its data are not used beyond ``len(dataset)``.
        progress_bar : bool, default=False
            Show laplace-torch's progress bar.

        """
        super().fit(train_loader, progress_bar=progress_bar)
        self._recompute_Sigma = False  # 0.2.3 leaves it set after fitting
        if self.reweight:
            weight = self.n_data / self.n_subset
            self._prior_factor_sod = 1.0
            if isinstance(self.L, list):
                self.L = [lam * weight for lam in self.L]
            else:
                self.L = self.L * weight
            self._build_Sigma_inv()
            self._recompute_Sigma = False

    def _get_SoD_data_loader(self, train_loader: DataLoader) -> DataLoader:
        """Locations with MAP pseudo-targets, batched like ``train_loader``."""
        Z = self.locations.to(self._device)
        with torch.no_grad():
            f = self.model(Z)
        y = f.argmax(dim=-1) if self.likelihood == "classification" else f
        return DataLoader(
            TensorDataset(Z, y), batch_size=train_loader.batch_size, shuffle=False
        )


def functional_laplace_on_locations(
    model: nn.Module,
    likelihood: str,
    locations: torch.Tensor,
    train_loader: DataLoader,
    **kwargs: Any,
) -> LocationFunctionalLaplace:
    """Build and fit a :class:`LocationFunctionalLaplace` in one call.

    Parameters
    ----------
    model : torch.nn.Module
        Trained network.
    likelihood : {'regression', 'classification'}
        The likelihood.
    locations : torch.Tensor
        Context locations ``(M, *input_shape)``.
    train_loader : DataLoader
        The training loader (its data set size sets ``N``).
    **kwargs
        Passed to :class:`LocationFunctionalLaplace`.

    Returns
    -------
    LocationFunctionalLaplace
        Fitted; call it as ``la(x, pred_type='gp')``.

    """
    la = LocationFunctionalLaplace(model, likelihood, locations, **kwargs)
    la.fit(train_loader)
    return la
