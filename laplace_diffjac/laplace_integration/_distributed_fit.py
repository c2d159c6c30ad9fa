"""laplace-torch's parametric ``fit`` over the shards of a process group.

Active only for estimators whose backend is one of this package's, and only while
a ``torch.distributed`` process group of more than one process is initialised;
otherwise every wrapped method is laplace-torch's own, unchanged.

Under a group each rank passes its own shard (:mod:`._shards`). The outermost
``fit`` replaces the loader by a :class:`~._shards.ShardedLoader` (global ``N``,
every rank's size checked once), so laplace-torch's subclass code (``FullLaplace``,
``KronLaplace``, ``LLLaplace``, ``SubnetLaplace``) runs as in one process; the data
pass (``ParametricLaplace.fit``) accumulates the curvature closure over the local
batches with the global ``N`` (KFAC's scaling) and sums ``loss`` and ``H`` (a
tensor, or every Kronecker factor) over the ranks in one ``all_reduce``. Every
rank then holds the posterior of the union of the shards, and
``log_marginal_likelihood``, ``optimize_prior_precision(method='marglik')`` and
the predictive need no change.

Kronecker factors are sums over batches of per-batch factors, so a one-process
reference equals the distributed fit up to rounding, whatever its batches.

``FunctionalLaplace``/``FunctionalLLLaplace`` fit on their GP subset gathered from
the shards (:mod:`._distributed_functional`). Estimators whose fit is not summed
over shards (``ELLA``, ``VaLLA``, ``LowRankLaplace``) refuse to fit under a group
with our backends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from laplace import baselaplace, lllaplace, subnetlaplace
from laplace.baselaplace import BaseLaplace, FunctionalLaplace, ParametricLaplace
from laplace.utils import Kron
from torch.nn.utils import parameters_to_vector

from .._progress import progress as progress_bar
from ..data import is_multi_process, rank, reduce_sum, reduce_sum_in_place
from ..errors import InvalidInputError
from ._distributed_functional import functional_entry
from ._patching import AttributePatch
from ._shards import ShardedLoader, shard

__all__ = ["distributed_fit_patches"]

#: ``uses_ours(estimator) -> bool``: whether its backend is one of ours.
BackendTest = Callable[[Any], bool]

_REFUSAL = (
    "{cls}.fit with this package's backends under a torch.distributed process "
    "group is not supported: {why} Fit in one process, or use a flavour that "
    "fits the union of the shards: subset_of_weights 'all'/'last_layer'/"
    "'subnetwork' x 'full'/'diag'/'kron', or hessian_structure='gp'."
)

_WHY_LOW_RANK = "its eigendecomposition needs the whole data set's curvature."
_WHY_FUNCTIONAL = (
    "its Nystrom basis / inducing points and their optimisation take passes over "
    "the whole data set that are not summed over the shards."
)


def _tensors_of(H: Any) -> list[torch.Tensor]:
    if isinstance(H, Kron):
        return [factor for factors in H.kfacs for factor in factors]
    return [H]


def _reduce_sums(loss: torch.Tensor, H: Any) -> tuple[torch.Tensor, Any]:
    """``loss`` and ``H`` summed over the ranks, in one ``all_reduce``.

    Parameters
    ----------
    loss : torch.Tensor
        Scalar local loss sum.
    H : torch.Tensor or laplace.utils.Kron
        Local curvature sum (``Kron`` factors are replaced in place). The
        reduction holds one copy of it (``all_reduce`` in place on that copy).

    Returns
    -------
    tuple
        The global loss and ``H``.

    """
    tensors = _tensors_of(H)
    dtype = tensors[0].dtype
    flat = torch.cat([loss.reshape(1).to(dtype)] + [t.reshape(-1) for t in tensors])
    flat = reduce_sum_in_place(flat)
    pieces = torch.split(flat, [1] + [t.numel() for t in tensors])
    if isinstance(H, Kron):
        new_kfacs = iter(p.view_as(t) for p, t in zip(pieces[1:], tensors))
        H.kfacs = [[next(new_kfacs) for _ in factors] for factors in H.kfacs]
        return pieces[0][0], H
    return pieces[0][0], pieces[1].view_as(H)


def _output_of_probe(la: Any, probe: Any) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(probe, MutableMapping):
            mapping: Any = type(probe)
            return la.model(mapping({k: _to(v, la._device) for k, v in probe.items()}))
        return la.model(probe[0].to(la._device))


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _batch(la: Any, data: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(data, MutableMapping):
        return data, data[la.dict_key_y].to(la._device)
    X, y = data
    return X.to(la._device), y.to(la._device)


def _local_sums(
    la: Any, loader: ShardedLoader, out_ndim: int, progress: bool
) -> tuple[torch.Tensor, Any, int]:
    """Loss, curvature and number of points of this rank's shard."""
    la._init_H()
    H, loss, count = la.H, torch.zeros((), dtype=la._dtype, device=la._device), 0
    N = len(loader.dataset)
    batches: Any = loader.local if loader.n_local > 0 else []
    for data in progress_bar(batches, desc="[Computing Hessian]", enabled=progress):
        X, y = _batch(la, data)
        if la.likelihood == "regression" and y.ndim != out_ndim:
            raise ValueError(
                f"The model's output has {out_ndim} dims but the target has "
                f"{y.ndim} dims."
            )
        la.model.zero_grad()
        loss_batch, H_batch = la._curv_closure(X, y, N=N)
        if isinstance(H, torch.Tensor):
            H.add_(H_batch)  # in place, as laplace-torch: one (P, P) buffer
        else:
            H = H + H_batch
        loss, count = loss + loss_batch, count + len(y)
    return loss, H, count


def _check_counts(loader: ShardedLoader, count: int) -> None:
    counts = torch.zeros(len(loader.sizes), dtype=torch.int64)
    counts[rank()] = count
    counts = reduce_sum(counts)
    for r, (seen, size) in enumerate(zip(counts.tolist(), loader.sizes)):
        if seen != size:
            raise InvalidInputError(
                f"distributed fit: rank {r}'s loader yielded {seen} points but its "
                f"shard holds {size} (len(dataset), or len(DistributedSampler)); a "
                "loader with drop_last=True or a sampler that skips points would "
                "make the global N wrong. Pass loaders that yield every point once."
            )


def distributed_pass(
    la: Any, loader: ShardedLoader, override: bool = True, progress_bar: bool = False
) -> None:
    """``ParametricLaplace.fit``'s data pass over the shards (collective).

    The same steps as laplace-torch's, with the global ``N = len(loader.dataset)``
    and the sums reduced over the ranks; with ``override=False`` the global sums
    are added to what the estimator held (the same on every rank).

    Parameters
    ----------
    la : ParametricLaplace
        The estimator.
    loader : ShardedLoader
        This rank's shard (see :func:`._shards.shard`).
    override, progress_bar : bool
        As in laplace-torch.

    """
    previous = None if override else (la.H, la.loss)
    la.model.eval()
    mean = parameters_to_vector(la.params)
    out = _output_of_probe(la, loader.probe)
    la.model.output_size = out.shape[-1]  # as laplace-torch, before the pass
    try:
        loss, H, count = _local_sums(la, loader, out.ndim, progress_bar)
        _check_counts(loader, count)
    except BaseException:
        if previous is not None:
            la.H = previous[0]
        raise
    loss, H = _reduce_sums(loss, H)
    if previous is not None:
        loss, H = previous[1] + loss, previous[0] + H
    else:
        la.n_data = 0
    la.mean = mean if la.enable_backprop else mean.detach()
    la.n_outputs = out.shape[-1]
    la.H, la.loss = H, loss
    la.n_data += len(loader.dataset)


def _data_pass(original: Callable, uses_ours: BackendTest) -> Callable:
    @functools.wraps(original)
    def fit(self: Any, train_loader: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(train_loader, ShardedLoader):
            return distributed_pass(self, train_loader, *args, **kwargs)
        if is_multi_process() and uses_ours(self):
            return distributed_pass(self, shard(train_loader), *args, **kwargs)
        return original(self, train_loader, *args, **kwargs)

    return fit


def _entry(original: Callable, uses_ours: BackendTest) -> Callable:
    @functools.wraps(original)
    def fit(self: Any, train_loader: Any, *args: Any, **kwargs: Any) -> None:
        if is_multi_process() and uses_ours(self):
            if not isinstance(train_loader, ShardedLoader):
                train_loader = shard(train_loader)
        return original(self, train_loader, *args, **kwargs)

    return fit


def _refusing(original: Callable, uses_ours: BackendTest, owner: type) -> Callable:
    low_rank = issubclass(owner, baselaplace.LowRankLaplace)
    why = _WHY_LOW_RANK if low_rank else _WHY_FUNCTIONAL

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        if is_multi_process() and uses_ours(self):
            raise NotImplementedError(_REFUSAL.format(cls=type(self).__name__, why=why))
        return original(self, *args, **kwargs)

    return fit


def _estimator_classes() -> list[type]:
    found: dict[type, None] = {}
    for module in (baselaplace, lllaplace, subnetlaplace):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseLaplace):
                found[value] = None
    return [cls for cls in found if cls is not BaseLaplace and "fit" in vars(cls)]


def distributed_fit_patches(
    uses_ours: BackendTest, inner: Callable[[type, Callable], Callable] | None = None
) -> list[AttributePatch]:
    """Patches of every laplace-torch estimator's own ``fit``.

    Parameters
    ----------
    uses_ours : callable
        ``uses_ours(estimator)``: whether the estimator's backend is one of ours.
    inner : callable, optional
        ``inner(cls, fit)``: a wrapper of laplace-torch's own ``fit`` of ``cls``,
        applied inside the distributed one (the adapter's other changes to
        ``fit``).

    Returns
    -------
    list of AttributePatch
        ``ParametricLaplace.fit`` does the sharded data pass; the other
        parametric classes' ``fit`` hand it a sharded loader; the GP estimators
        fit on the gathered subset; ``LowRankLaplace``, ``ELLA`` and ``VaLLA``
        refuse under a group.

    """
    patches = []
    for cls in _estimator_classes():
        original = vars(cls)["fit"]
        if inner is not None:
            original = inner(cls, original)
        if cls is ParametricLaplace:
            wrapped = _data_pass(original, uses_ours)
        elif issubclass(cls, ParametricLaplace) and not issubclass(
            cls, baselaplace.LowRankLaplace
        ):
            wrapped = _entry(original, uses_ours)
        elif issubclass(cls, FunctionalLaplace):
            wrapped = functional_entry(original, uses_ours)
        else:
            wrapped = _refusing(original, uses_ours, cls)
        patches.append(AttributePatch(cls, "fit", wrapped))
    return patches
