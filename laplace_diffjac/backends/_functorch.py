"""``DiffFuncGGN``: the same contract as the BackPACK backends, on ``torch.func``.

Jacobians are per-sample ``vmap(jacrev(functional_call))``, so the cost grows
linearly with the batch (whole-batch ``jacrev`` grows quadratically); models with
recurrent layers or cells (``nn.RNN``/``nn.LSTM``/``nn.GRU``, whose fused kernels
``vmap`` cannot batch, and ``nn.RNNCell``/``LSTMCell``/``GRUCell``) take
``jacrev`` sample by sample instead, and so do models ``vmap`` cannot trace
(``.item()`` or data-dependent control flow in the forward pass, as in Hugging
Face's attention masks of BERT and of GPT-2's default ``sdpa`` attention), found
by running the first sample's forward pass under ``vmap`` (``_functorch_routes``).
Normalisations and ``nn.PReLU`` run in elementary operations
(``jacobians/_elementary.py``: PyTorch's derivatives of their fused kernels are
wrong under these transforms). Works for any model ``torch.func``'s ``jacrev``
can trace (LayerNorm, attention, custom functions) and for dict-like inputs.
``torch.func`` never touches ``.grad``, registers no hooks and stores nothing on
the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from laplace.curvature import GGNInterface
from laplace.utils import Kron
from torch import nn
from torch.func import functional_call, grad, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import InvalidInputError, UnsupportedModuleError
from ..jacobians._elementary import elementary_forms
from ..jacobians._inputs import (
    check_mapping_or_tensor_batch,
    check_model_output,
)
from ..jacobians._last_layer import last_layer_jacobians
from ..jacobians._model_guard import preserved_state
from ._functorch_routes import map_over_samples
from ._functorch_support import (
    check_functorch_support,
    quiet_batching_fallbacks,
    refused_packed_sequences,
)
from ._kfac import check_kfac_support, kfac_factors


class DiffFuncGGN(GGNInterface):
    """GGN backend on ``torch.func`` with graph-connected, side-effect-free methods.

    Per-sample Jacobians and gradients are ``vmap`` over samples of ``jacrev`` of
    ``functional_call``. Where ``vmap`` cannot trace the model (its forward pass
    on the first sample raises: ``.item()`` or data-dependent control flow, as in
    Hugging Face ``transformers``' attention masks) and for recurrent layers and
    cells, every method runs the samples one by one instead, each as a batch of
    one: the same results, graph-connected as well, without a warning, slower by
    the Python overhead of one call per sample.

    Parameters
    ----------
    model : torch.nn.Module
        The network (or laplace-torch ``FeatureExtractor`` for last-layer Laplace).
    likelihood : {'classification', 'regression'}
    last_layer : bool, default=False
        Curvature of the last layer only.
    subnetwork_indices : torch.LongTensor, optional
        Indices of the flattened parameter vector that form the subnetwork.
    **kwargs
        Passed on to laplace-torch (``dict_key_x``, ``dict_key_y``, ``stochastic``,
        ``num_samples``).

    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: Any,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> None:
        # laplace-torch's own constructor; spelled out so that its parameters are
        # those documented above (the API reference reads the signature).
        super().__init__(model, likelihood, last_layer, subnetwork_indices, **kwargs)

    def _named_params(self) -> dict[str, torch.Tensor]:
        """Trainable parameters of ``self._model``, named as in ``self.model``."""
        wanted = {id(p) for p in self.params}
        return {name: p for name, p in self.model.named_parameters() if id(p) in wanted}

    def _per_sample_outputs(self, x: Any, params: dict[str, torch.Tensor]) -> Any:
        model = self.model

        def single(p: dict[str, torch.Tensor], xi: Any) -> torch.Tensor:
            batch = _unsqueeze(xi)
            out = functional_call(model, p, (batch,), strict=False)
            return out.squeeze(0)

        return single

    def jacobians(
        self, x: Any, enable_backprop: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample Jacobians of all outputs with respect to the parameters.

        Parameters
        ----------
        x : torch.Tensor or mapping
            Input batch ``(batch, *input_shape)``, or a mapping of such tensors.
        enable_backprop : bool, default=False
            Keep ``Js`` and ``f`` connected to the graph of ``x`` and the parameters.

        Returns
        -------
        Js : torch.Tensor
            ``(batch, outputs, parameters)``.
        f : torch.Tensor
            ``(batch, outputs)``.

        """
        return self._jacobians(x, None, enable_backprop)

    def selected_output_jacobians(
        self, x: Any, outputs: torch.Tensor, enable_backprop: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Jacobians of chosen outputs per sample.

        Parameters
        ----------
        x : torch.Tensor or mapping
            Input batch.
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
        outputs = outputs if outputs.dim() == 2 else outputs[:, None]
        return self._jacobians(x, outputs.long(), enable_backprop)

    def _jacobians(
        self, x: Any, selected: torch.Tensor | None, enable_backprop: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = check_mapping_or_tensor_batch(x, self.model, type(self).__name__)
        if isinstance(x, Mapping):
            x = {k: v for k, v in x.items() if isinstance(v, torch.Tensor)}
        if selected is not None and selected.shape[0] != batch:
            raise InvalidInputError(
                f"Output selectors have {selected.shape[0]} rows but the batch has "
                f"{batch}; pass one row of output indices per input."
            )
        _check_no_backward_hooks(self.model)
        check_functorch_support(self.model)
        params = self._named_params()
        single = self._per_sample_outputs(x, params)
        if selected is not None:
            _check_selector_range(selected, single, params, x)

        def with_aux(p: dict[str, torch.Tensor], xi: Any, sel: Any) -> tuple:
            out = single(p, xi)
            out = out if out.dim() == 1 else out.reshape(-1)
            picked = out if sel is None else out[sel]
            return picked, out

        def jac_and_value(p: dict[str, torch.Tensor], xi: Any, sel: Any) -> tuple:
            return jacrev(lambda q: with_aux(q, xi, sel), has_aux=True)(p)

        if not enable_backprop:
            x = _detach(x)
        with torch.set_grad_enabled(enable_backprop):
            jac, f = self._per_sample(jac_and_value, params, x, selected, batch)
            Js = torch.cat([j.flatten(start_dim=2) for j in jac.values()], dim=2)
        f = check_model_output(f, batch)
        if self.subnetwork_indices is not None:
            Js = Js[..., self.subnetwork_indices]
        if not enable_backprop:
            return Js.detach(), f.detach()
        return Js, f

    def _per_sample(
        self,
        fn: Callable,
        params: dict[str, torch.Tensor],
        x: Any,
        per_sample: torch.Tensor | None,
        batch: int,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``vmap(fn)`` over the samples of ``x`` (and ``per_sample``), or a loop.

        Runs inside everything the transforms need: the model's state kept, the
        elementary forms of norms and PReLU, the composite attention kernel. The
        route (``vmap``, or a loop where ``vmap`` cannot trace the model) is
        ``_functorch_routes.map_over_samples``'s.

        Returns
        -------
        dict of torch.Tensor
            The first results of ``fn``, stacked over samples, by parameter name.
        torch.Tensor
            Its second results, stacked.

        """
        # functional_call rebinds RNN modules' flat-weight lists: put them back.
        with (
            preserved_state(self.model),
            elementary_forms(self.model),  # norms, PReLU: right derivatives
            # composite attention: the fused CPU kernels have no double backward
            sdpa_kernel([SDPBackend.MATH]),
            quiet_batching_fallbacks(),
            refused_packed_sequences(self.model),
        ):
            forward = self._per_sample_outputs(x, params)
            return map_over_samples(
                fn, forward, params, x, per_sample, batch, self.model
            )

    def gradients(self, x: Any, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample gradients of the sum-reduced loss, on the same transforms.

        Parameters
        ----------
        x : torch.Tensor or mapping
            Input batch ``(batch, *input_shape)``, or a mapping of such tensors.
        y : torch.Tensor
            Targets ``(batch, ...)``.

        Returns
        -------
        Gs : torch.Tensor
            ``(batch, parameters)``, detached.
        loss : torch.Tensor
            Scalar loss (not multiplied by ``factor``, as in laplace-torch).

        """
        batch = check_mapping_or_tensor_batch(x, self.model, type(self).__name__)
        if isinstance(x, Mapping):
            x = {k: v for k, v in x.items() if isinstance(v, torch.Tensor)}
        _check_no_backward_hooks(self.model)
        check_functorch_support(self.model)
        params = self._named_params()
        single = self._per_sample_outputs(x, params)
        lossfunc = self.lossfunc

        def grad_and_loss(p: dict[str, torch.Tensor], xi: Any, yi: Any) -> tuple:
            def loss_of(q: dict[str, torch.Tensor]) -> tuple:
                loss = lossfunc(single(q, xi).unsqueeze(0), yi.unsqueeze(0))
                return loss, loss

            return grad(loss_of, has_aux=True)(p)

        with torch.no_grad():
            grads, losses = self._per_sample(
                grad_and_loss, params, _detach(x), y, batch
            )
        Gs = torch.cat([g.flatten(start_dim=1) for g in grads.values()], dim=1)
        if self.subnetwork_indices is not None:
            Gs = Gs[:, self.subnetwork_indices]
        return Gs.detach(), losses.sum().detach()

    def last_layer_jacobians(
        self, x: Any, enable_backprop: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Jacobians with respect to the last layer's parameters.

        Parameters
        ----------
        x : torch.Tensor or mapping
            Input batch.
        enable_backprop : bool, default=False
            Keep the results connected to the graph of ``x``.

        Returns
        -------
        Js : torch.Tensor
            ``(batch, outputs, last-layer parameters)``.
        f : torch.Tensor
            ``(batch, outputs)``.

        """
        check_mapping_or_tensor_batch(x, self.model, type(self).__name__)
        return last_layer_jacobians(self.model, x, enable_backprop)

    def kron(
        self, x: Any, y: torch.Tensor, N: int, **kwargs: Any
    ) -> tuple[torch.Tensor, Kron]:
        """Kronecker-factored GGN (or MC Fisher) on one batch, via curvlinops' KFAC.

        The factors follow ``BackPackGGN.kron``: ``[G, A]`` per weight and ``[G]``
        per bias of every ``nn.Linear``/``nn.Conv2d`` with trainable parameters
        (frozen ones are left out), ``A`` rescaled by ``len(y) / N`` and all
        multiplied by ``factor``.

        Parameters
        ----------
        x : torch.Tensor or mapping
            Input batch ``(batch, *input_shape)``, or a mapping of such tensors.
        y : torch.Tensor
            Targets.
        N : int
            Size of the whole data set, to rescale the factors.
        **kwargs
            Ignored (laplace-torch's signature).

        Returns
        -------
        loss : torch.Tensor
            ``factor * loss``.
        H : laplace.utils.Kron
            Kronecker factors per trainable parameter.

        Raises
        ------
        InvalidInputError
            If ``x`` is not a valid batch.
        UnsupportedModuleError
            If a trainable parameter belongs to a module other than ``nn.Linear``
            or ``nn.Conv2d`` (the message sends to ``'diag'``/``'full'`` with this
            backend and to ``DiffBackPackGGN`` for ``'kron'``), or if subnetwork
            indices are set.

        """
        if self.subnetwork_indices is not None:
            raise UnsupportedModuleError(
                "Kronecker factors are not defined for a subnetwork; use "
                "hessian_structure='full' or 'diag' with SubnetLaplace."
            )
        check_mapping_or_tensor_batch(x, self.model, type(self).__name__)
        check_kfac_support(self.model, self.params)
        stochastic = bool(getattr(self, "stochastic", False))
        flatten = self.likelihood != "regression"
        model = _FlatOutputs(self.model) if flatten else self.model
        targets = y.reshape(-1) if flatten else y
        loss, kron = kfac_factors(
            model,
            self.lossfunc,
            self.params,
            x,
            targets,
            stochastic=stochastic,
        )
        for block in kron.kfacs:
            if len(block) == 2:
                block[1] *= len(y) / N
        return self.factor * loss, self.factor * kron


class _FlatOutputs(nn.Module):
    """``model`` with outputs reshaped to ``(-1, C)``.

    laplace-torch's BackPACK backends flatten classification outputs (for instance
    sequence logits) the same way.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Any) -> torch.Tensor:
        f = self.model(x)
        return f.reshape(-1, f.shape[-1])


def _check_no_backward_hooks(model: nn.Module) -> None:
    hooked = [
        name or "<root>"
        for name, m in model.named_modules()
        if m._backward_hooks or m._backward_pre_hooks
    ]
    if hooked:
        raise UnsupportedModuleError(
            f"Modules {hooked} carry backward hooks (for instance from "
            "backpack.extend), which torch.func cannot trace (pytorch/functorch#1124). "
            "Use laplace_diffjac.DiffBackPackGGN for this model, or remove the hooks."
        )


def _unsqueeze(xi: Any) -> Any:
    if isinstance(xi, Mapping):
        return {k: v.unsqueeze(0) for k, v in xi.items()}
    return xi.unsqueeze(0)


def _detach(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: v.detach() for k, v in x.items()}
    return x.detach()


__all__ = ["DiffFuncGGN"]


def _check_selector_range(
    selected: torch.Tensor,
    single: Callable[[dict[str, torch.Tensor], Any], torch.Tensor],
    params: dict[str, torch.Tensor],
    x: Any,
) -> None:
    """Refuse output indices outside ``[0, C)``, from one sample's forward pass.

    Raises
    ------
    InvalidInputError
        For an index outside ``[0, C)``.

    """
    if not selected.numel():
        return
    first = {k: v[0] for k, v in x.items()} if isinstance(x, Mapping) else x[0]
    with torch.no_grad():
        n_out = single(params, first).numel()
    if selected.min() < 0 or selected.max() >= n_out:
        raise InvalidInputError(
            f"Output selectors must lie in [0, {n_out}) (the model has {n_out} "
            "outputs)."
        )
