"""``DiffBackPackGGN`` and ``DiffBackPackEF``: laplace-torch's BackPACK backends.

Both are reimplemented on the package's Jacobian engine
(:mod:`laplace_diffjac.jacobians`): Jacobians, gradients and the curvature (``diag``,
``kron``, ``full``) of any module structure it takes, with dict-like inputs, and
nothing of BackPACK's extensions.

Every method that runs a backward pass is replaced. The results equal laplace-torch's
(see the tests), but: no ``.grad`` is written anywhere, nothing is left on the model
(hooks, ``grad_batch``, ``input0``, ...), BackPACK's global hook registry is never
touched, constructing a backend changes nothing on the model, one forward pass serves
all outputs, and with ``enable_backprop=True`` results are differentiable with
respect to the input and the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from laplace.curvature import BackPackEF, BackPackGGN, BackPackInterface
from laplace.utils import Kron
from torch import nn

from ..jacobians._curvature import (
    ef_diagonal,
    ggn_diagonal,
    ggn_kronecker_factors,
)
from ..jacobians._engine import (
    JacobianFactors,
    jacobian_factors,
    jacobian_pieces,
    parameter_jacobians,
    per_sample_gradients,
)
from ..jacobians._inputs import check_mapping_or_tensor_batch
from ..jacobians._kronecker import check_kfac_approx
from ..jacobians._last_layer import last_layer_jacobians
from ..jacobians._linear_layers import LinearSignals
from ._chunking import (
    DEFAULT_JACOBIAN_BUDGET,
    ChunkedCurvature,
    check_budget,
)

#: What an engine entry point returns (:meth:`_SideEffectFreeBackPack._engine_pass`).
_Pieces = TypeVar("_Pieces")


class _SideEffectFreeBackPack(ChunkedCurvature):
    """Methods shared by both BackPACK backends.

    Mixed in before laplace-torch's class, so these replace its methods; the
    constructor skips ``BackPackInterface.__init__``, which would ``extend`` the model
    and its loss (global hooks that break ``torch.func``). ``jacobian_budget``
    (bytes; default half the memory budget in force, 1 GiB on a CPU) bounds each
    chunk of per-sample Jacobians (``_chunking``).
    """

    model: nn.Module
    params: list[torch.Tensor]
    lossfunc: Any
    likelihood: Any
    factor: float
    subnetwork_indices: torch.LongTensor | None

    def __init__(
        self,
        model: nn.Module,
        likelihood: Any,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        jacobian_budget: int | None = DEFAULT_JACOBIAN_BUDGET,
        **kwargs: Any,
    ) -> None:
        self.jacobian_budget = check_budget(jacobian_budget)
        super(BackPackInterface, self).__init__(  # type: ignore[call-arg]
            model,
            likelihood,
            last_layer=last_layer,
            subnetwork_indices=subnetwork_indices,
            **kwargs,
        )

    @property
    def _name(self) -> str:
        return type(self).__name__

    def _check_input(self, x: Any) -> None:
        check_mapping_or_tensor_batch(x, self.model, self._name)

    def _select(self, J: torch.Tensor) -> torch.Tensor:
        if self.subnetwork_indices is None:
            return J
        return J[..., self.subnetwork_indices]

    def jacobians(
        self, x: torch.Tensor | Mapping[str, Any], enable_backprop: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample Jacobians of all outputs with respect to the parameters.

        Parameters
        ----------
        x : torch.Tensor or Mapping
            Input batch ``(batch, *input_shape)`` on the model's device and dtype,
            or a dict-like batch (``dict``, ``UserDict`` such as ``BatchEncoding``)
            that the model takes as a whole; the batch size is that of its tensors.
        enable_backprop : bool, default=False
            Keep ``Js`` and ``f`` connected to the graph of ``x`` and the
            parameters, so that functions of them can be differentiated.

        Returns
        -------
        Js : torch.Tensor
            ``(batch, outputs, parameters)``.
        f : torch.Tensor
            Model output ``(batch, outputs)``.

        """
        check_mapping_or_tensor_batch(x, self.model, self._name)
        Js, f = self._chunked_jacobians(
            lambda part: parameter_jacobians(
                self.model,
                part,
                self.params,
                root=self._model,  # type: ignore[attr-defined]
                enable_backprop=enable_backprop,
            ),
            x,
            last_layer=False,
        )
        return self._select(Js), f

    def jacobian_factors(
        self, x: torch.Tensor | Mapping[str, Any], enable_backprop: bool = False
    ) -> JacobianFactors:
        """The per-layer factors of :meth:`jacobians`, never assembled into ``J``.

        What :func:`laplace_diffjac.kernels.ntk` contracts layer by layer. Not
        restricted to a subnetwork (``subnetwork_indices`` select columns of the
        assembled ``J``).

        Parameters
        ----------
        x : torch.Tensor or Mapping
            Input batch ``(batch, *input_shape)`` or a dict-like batch.
        enable_backprop : bool, default=False
            Keep the factors connected to the graph of ``x`` and the parameters.

        Returns
        -------
        JacobianFactors
            Factors keyed by ``id`` of each entry of ``self.params``.

        """
        return self._engine_pass(jacobian_factors, x, enable_backprop)

    def jacobian_pieces(
        self, x: torch.Tensor | Mapping[str, Any], enable_backprop: bool = False
    ) -> LinearSignals | JacobianFactors:
        """The Linear layers' inputs and signals where they are all, else factors.

        What :func:`laplace_diffjac.kernels.ntk` contracts layer by layer, from
        one pass (:func:`laplace_diffjac.jacobians._engine.jacobian_pieces`).

        Parameters
        ----------
        x : torch.Tensor or Mapping
            Input batch ``(batch, *input_shape)`` or a dict-like batch.
        enable_backprop : bool, default=False
            Keep the pieces connected to the graph of ``x`` and the parameters.

        Returns
        -------
        LinearSignals or JacobianFactors
            The former where every parameter belongs to an ``nn.Linear`` called
            once on one feature vector per input.

        """
        return self._engine_pass(jacobian_pieces, x, enable_backprop)

    def _engine_pass(
        self,
        engine: Callable[..., _Pieces],
        x: torch.Tensor | Mapping[str, Any],
        enable_backprop: bool,
    ) -> _Pieces:
        """An engine entry point over this backend's model and parameters.

        Returns
        -------
        object
            What ``engine`` returns for ``x``, checked first.
        """
        check_mapping_or_tensor_batch(x, self.model, self._name)
        return engine(
            self.model,
            x,
            self.params,
            root=self._model,  # type: ignore[attr-defined]
            enable_backprop=enable_backprop,
        )

    def last_layer_jacobians(
        self, x: torch.Tensor | Mapping[str, Any], enable_backprop: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Jacobians with respect to the last layer's parameters.

        Parameters
        ----------
        x : torch.Tensor or Mapping
            Input batch ``(batch, *input_shape)`` or a dict-like batch.
        enable_backprop : bool, default=False
            Keep the results connected to the graph of ``x``.

        Returns
        -------
        Js : torch.Tensor
            ``(batch, outputs, last-layer parameters)``.
        f : torch.Tensor
            ``(batch, outputs)``.

        """
        check_mapping_or_tensor_batch(x, self.model, self._name)
        return self._chunked_jacobians(
            lambda part: last_layer_jacobians(self.model, part, enable_backprop),
            x,
            last_layer=True,
        )

    def selected_output_jacobians(
        self,
        x: torch.Tensor | Mapping[str, Any],
        outputs: torch.Tensor,
        enable_backprop: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Jacobians of chosen outputs per sample, in one forward and one backward.

        Parameters
        ----------
        x : torch.Tensor or Mapping
            Input batch ``(batch, *input_shape)`` or a dict-like batch.
        outputs : torch.Tensor
            Output indices ``(batch,)`` or ``(batch, selected)``.
        enable_backprop : bool, default=False
            Keep the results connected to the graph of ``x``.

        Returns
        -------
        Js : torch.Tensor
            ``(batch, selected, parameters)``.
        f : torch.Tensor
            ``(batch, outputs)``.

        """
        check_mapping_or_tensor_batch(x, self.model, self._name)
        Js, f = parameter_jacobians(
            self.model,
            x,
            self.params,
            root=self._model,  # type: ignore[attr-defined]
            enable_backprop=enable_backprop,
            selected_outputs=outputs,
        )
        return self._select(Js), f

    def gradients(
        self, x: torch.Tensor | Mapping[str, Any], y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample gradients of the sum-reduced loss.

        Parameters
        ----------
        x : torch.Tensor or Mapping
            Input batch ``(batch, *input_shape)`` or a dict-like batch.
        y : torch.Tensor
            Targets ``(batch, ...)``.

        Returns
        -------
        Gs : torch.Tensor
            ``(batch, parameters)``.
        loss : torch.Tensor
            Scalar loss (not multiplied by ``factor``, as in laplace-torch).

        """
        check_mapping_or_tensor_batch(x, self.model, self._name)
        Gs, loss = per_sample_gradients(
            self.model,
            x,
            lambda f: self.lossfunc(f, y),
            self.params,
            root=self._model,  # type: ignore[attr-defined]
        )
        return self._select(Gs), loss

    def _loss_and_diagonal(
        self, x: torch.Tensor | Mapping[str, Any], y: torch.Tensor, *, rows: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``factor`` times the loss and the diagonal of the GGN, its MC or the EF."""
        check_mapping_or_tensor_batch(x, self.model, self._name)
        root: nn.Module = self._model  # type: ignore[attr-defined]
        args = (self.model, root, self.lossfunc, x, y, self.params)
        if rows == "gradients":
            loss, diag = ef_diagonal(*args)
        else:
            loss, diag = ggn_diagonal(*args, stochastic=rows == "mc")
        if self.subnetwork_indices is not None:
            diag = diag[self.subnetwork_indices]
        return self.factor * loss, self.factor * diag


class DiffBackPackGGN(_SideEffectFreeBackPack, BackPackGGN):
    """laplace-torch's ``BackPackGGN`` with graph-connected, side-effect-free methods.

    Parameters
    ----------
    model : torch.nn.Module
        The network (or laplace-torch ``FeatureExtractor`` for last-layer Laplace).
    likelihood : {'classification', 'regression'}
    last_layer : bool, default=False
        Curvature of the last layer only.
    subnetwork_indices : torch.LongTensor, optional
        Indices of the flattened parameter vector that form the subnetwork.
    stochastic : bool, default=False
        Monte-Carlo Fisher (``DiagGGNMC``/``KFAC``) instead of the exact GGN.
    jacobian_budget : int, optional
        Bytes of per-sample Jacobians computed at once (``full``, ``jacobians``);
        by default half the memory budget in force at the call
        (:func:`laplace_diffjac.set_memory_budget`; 1 GiB at the CPU's default).
        A single sample above it is refused with an error naming it.
    kfac_approx : {'expand', 'reduce'}, default='expand'
        ``kron``'s KFAC setting for layers shared over tokens (Eschenhagen et al.
        2023; curvlinops' default is ``'expand'``); no effect without tokens.
    **kwargs
        Passed on to laplace-torch (``dict_key_x``, ``dict_key_y``).

    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Any,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        stochastic: bool = False,
        jacobian_budget: int | None = DEFAULT_JACOBIAN_BUDGET,
        kfac_approx: str = "expand",
        **kwargs: Any,
    ) -> None:
        self.kfac_approx = check_kfac_approx(kfac_approx)
        super().__init__(
            model,
            likelihood,
            last_layer,
            subnetwork_indices,
            jacobian_budget=jacobian_budget,
            **kwargs,
        )
        self.stochastic = stochastic

    def diag(
        self, x: torch.Tensor | Mapping[str, Any], y: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Diagonal of the GGN (or MC Fisher) on one batch, for any module structure.

        Parameters
        ----------
        x : torch.Tensor or Mapping
            Input batch ``(batch, *input_shape)`` or a dict-like batch.
        y : torch.Tensor
            Targets.
        **kwargs
            Ignored (laplace-torch's signature).

        Returns
        -------
        loss : torch.Tensor
            ``factor * loss``.
        H : torch.Tensor
            ``(parameters,)``.

        """
        return self._loss_and_diagonal(x, y, rows="mc" if self.stochastic else "ggn")

    def kron(
        self,
        x: torch.Tensor | Mapping[str, Any],
        y: torch.Tensor,
        N: int,
        kfac_approx: str | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Kron]:
        """Kronecker-factored GGN (or MC Fisher) on one batch, for any module structure.

        BackPACK's ``KFLR``/``KFAC`` factors for ``Linear`` and convolution layers
        without tokens; KFAC-expand or -reduce for layers shared over tokens; the
        exact block, or its nearest Kronecker product, for other parameters (see
        :mod:`laplace_diffjac.jacobians._kronecker`).

        Parameters
        ----------
        x : torch.Tensor or Mapping
            Input batch ``(batch, *input_shape)`` or a dict-like batch.
        y : torch.Tensor
            Targets.
        N : int
            Size of the whole data set, to rescale the factors.
        kfac_approx : {'expand', 'reduce'}, optional
            This call's KFAC setting; the backend's ``kfac_approx`` by default.
        **kwargs
            Ignored (laplace-torch's signature).

        Returns
        -------
        loss : torch.Tensor
            ``factor * loss``.
        H : laplace.utils.Kron
            Kronecker factors per parameter.

        """
        check_mapping_or_tensor_batch(x, self.model, self._name)
        approx = check_kfac_approx(kfac_approx or self.kfac_approx)
        loss, factors = ggn_kronecker_factors(
            self.model,
            self._model,
            self.lossfunc,
            x,
            y,
            self.params,
            stochastic=self.stochastic,
            approx=approx,
        )
        kron = self._rescale_kron_factors(Kron(factors), len(y), N)
        return self.factor * loss, self.factor * kron


class DiffBackPackEF(_SideEffectFreeBackPack, BackPackEF):
    """laplace-torch's ``BackPackEF`` with graph-connected, side-effect-free methods.

    Parameters
    ----------
    model : torch.nn.Module
        The network (or laplace-torch ``FeatureExtractor`` for last-layer Laplace).
    likelihood : {'classification', 'regression'}
    last_layer : bool, default=False
        Curvature of the last layer only.
    subnetwork_indices : torch.LongTensor, optional
        Indices of the flattened parameter vector that form the subnetwork.
    jacobian_budget : int, optional
        Bytes of per-sample gradients computed at once by ``full``; by default
        half the memory budget in force at the call.
    **kwargs
        Passed on to laplace-torch (``dict_key_x``, ``dict_key_y``).

    """

    _jacobian_rows = 1  # full() takes per-sample gradients, one row per sample

    def diag(
        self, x: torch.Tensor | Mapping[str, Any], y: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Diagonal of the empirical Fisher on one batch, for any module structure.

        Parameters
        ----------
        x : torch.Tensor or Mapping
            Input batch ``(batch, *input_shape)`` or a dict-like batch.
        y : torch.Tensor
            Targets.
        **kwargs
            Ignored (laplace-torch's signature).

        Returns
        -------
        loss : torch.Tensor
            ``factor * loss``.
        H : torch.Tensor
            ``(parameters,)``.

        """
        return self._loss_and_diagonal(x, y, rows="gradients")
