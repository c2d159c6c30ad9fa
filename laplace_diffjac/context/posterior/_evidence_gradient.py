"""The evidence bound as an objective in the locations (and hyperparameters).

``evidence_loss_backward`` returns ``−bound(Z, δ, σ)`` (the bound of
:mod:`~laplace_diffjac.context.posterior._evidence`, scalar prior) on the whole
data set and accumulates its *exact* gradient into ``.grad`` of the locations and
of the prior precision / noise tensors that require gradients, with the memory of one
minibatch. The bound depends on the data only through the whitened sum
``W(Z) = Σₙ Vₙ Λ̃ₙ Vₙᵀ``, ``Vₙ = L(Z)⁻¹ K_Zn`` with ``L(Z) L(Z)ᵀ = K⁰_ZZ + ε I``
(:mod:`._statistics`), and through ``Z``-independent sums, so::

    ∂bound/∂Z = Σ_batches ⟨∂F/∂W, ∂W_batch/∂Z⟩

Pass 1 accumulates ``W`` without a graph; ``F(W, δ, σ)`` is differentiated with
``W`` as a leaf (giving ``∂F/∂W`` and the hyperparameters' gradients); pass 2
recomputes each batch's ``W_batch(Z)`` with a graph (the frame ``L(Z)`` once)
and back-propagates ``⟨∂F/∂W, W_batch⟩``.
The logarithm of a determinant of a data sum is not a sum over data, so an
unbiased *minibatch* estimate of this gradient does not exist in this form; the
two passes give the full-data gradient at twice the cost of a ``fit``.

Within the memory budget (:mod:`laplace_diffjac.budget`): pass 1 takes the data
in chunks and the locations in blocks as :meth:`ContextPosterior.fit` does
(:func:`._chunks.plan_chunks`); pass 2 holds the locations' features with their
graph (they are differentiated once per data chunk) and sizes its data chunks
for what is left. Where they do not fit, pass 2 takes the Grams as leaves and
computes the locations' features again with their graph, block by block, for
every data chunk (:mod:`._evidence_blocks`). A budget that cannot hold one
location and one input beside ``K_ZZ`` is refused before any work.

The Nyström gap minimised by ``optimize_locations`` is, up to the factor ``h``
and ``½``, the bound's trace term: the bound adds the ``log det`` term, which
rewards locations that explain the *curvature-weighted* directions of the data,
and the hyperparameter terms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...backends import JacobianBackend
from ...budget import get_memory_budget
from ...data import (
    Data,
    TrainingData,
    check_shard,
    check_targets,
    is_distributed,
    reduce_sum,
)
from ...kernels import output_hessians
from ...kernels._feature_sizes import FeatureSizes, feature_sizes
from ._chunks import ChunkedFeatures, Chunks, largest_fitting, plan_chunks, slices
from ._evidence import log_det_eye_plus, log_likelihood
from ._evidence_blocks import (
    BlockedGradientPlan,
    blocked_data_gradient,
    plan_blocked_gradient,
    whitened_sum,
)
from ._features import BatchFeatures, batch_features
from ._hyperparameters import PriorGroups
from ._statistics import Accumulators, frame_factor, reduce_accumulators

__all__ = ["evidence_loss_backward"]


def _bound(
    acc: Accumulators,
    W: torch.Tensor,
    theta: torch.Tensor,
    prec: torch.Tensor,
    sigma: torch.Tensor,
    likelihood: str,
    temperature: float,
) -> torch.Tensor:
    """The bound from the whitened sums ``W`` (``A = s h W``, one prior group)."""
    s = prec.to(torch.float64).reshape(()).reciprocal()
    sigma2 = sigma.to(torch.float64).square() if likelihood == "regression" else 1.0
    h = 1.0 / (sigma2 * temperature)
    A = (s * h) * W
    log_det = log_det_eye_plus(A, acc.jitter)
    trace = h * s * acc.ggn_diag.sum() - A.diagonal().sum()
    scatter = theta.square().sum() / s
    n_out = acc.n_outputs
    loglik = log_likelihood(acc, likelihood, sigma, temperature, n_out)
    return loglik - 0.5 * (scatter + log_det + trace)


def evidence_loss_backward(
    backend: JacobianBackend,
    locations: torch.Tensor,
    data: Data,
    likelihood: str,
    prior_precision: torch.Tensor,
    sigma_noise: torch.Tensor,
    temperature: float = 1.0,
    jitter: float = 1e-6,
    batch_size: int = 256,
    inputs: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``−bound`` on all data; its exact gradient goes into ``.grad``.

    Parameters
    ----------
    backend : JacobianBackend
        Graph-connected backend (``DiffBackPackGGN``, ``DiffFuncGGN``).
    locations : torch.Tensor
        ``Z`` ``(M, *input_shape)``; gets ``.grad`` if it requires grad.
    data : DataLoader or tuple
        Training data with targets (``(x, y)`` batches or a tuple ``(x, y)``);
        a loader (also over an ``IterableDataset``) is read twice, one batch at
        a time. Under ``torch.distributed``: this rank's shard (may be empty);
        the data sums and the gradient in ``Z`` are all-reduced, so the loss and
        every ``.grad`` are the same on every rank (all ranks must call it).
    likelihood : {'regression', 'classification'}
        The likelihood.
    prior_precision : torch.Tensor
        Scalar prior precision ``()`` or ``(1,)`` (e.g. ``log_prec.exp()``);
        gradients flow to whatever it was computed from.
    sigma_noise : torch.Tensor
        ``()`` observation noise (ignored for classification).
    temperature : float, default=1.0
        Likelihood temperature.
    jitter : float, default=1e-6
        Relative jitter of ``K_ZZ`` (the optimiser's default).
    batch_size : int, default=256
        Batch size for a tuple.
    inputs : sequence of torch.Tensor, optional
        Leaf tensors whose ``.grad`` receives the gradient (e.g.
        ``[Z, log_prec, log_sigma]``); default ``[locations]``. Nothing else (in
        particular no model parameter) is touched.

    Returns
    -------
    torch.Tensor
        ``()`` float64, detached: ``−bound`` (minimise it).

    Raises
    ------
    ValueError
        If the data has no targets or the prior precision is not scalar.
    InvalidInputError
        For a ``DistributedSampler`` that pads its shards with repeated points.
    MemoryBudgetError
        If not even one location's features with their graph and one input's
        fit the memory budget beside ``K_ZZ``, before any work.

    """
    if prior_precision.numel() != 1:
        raise ValueError("evidence_loss_backward takes a scalar prior precision.")
    P = sum(p.numel() for p in backend.params)
    weight = torch.ones(P, dtype=torch.float64, device=locations.device)
    groups = PriorGroups("scalar", ((0, P),), weight, len(backend.params))
    check_shard(data, "data")
    training_data = TrainingData(data, batch_size, "data")
    loader = training_data.loader
    largest = batch_size if loader is None else loader.batch_size or 1024
    sizes = feature_sizes(backend, locations.detach(), True)
    budget = get_memory_budget(locations.device)
    gradient_plan = _gradient_plan(sizes, len(locations), largest, budget)
    chunks = plan_chunks(sizes, len(locations), largest, 1, budget)
    with torch.no_grad():
        Z0 = _location_features(backend, locations.detach(), chunks)
        acc = Accumulators.empty(Z0, groups, jitter)
        for xb, yb in training_data.batches():
            xb = xb.to(locations.device)
            for where in slices(len(xb), chunks.data):
                features = batch_features(backend, xb[where], False)
                y = None if yb is None else yb[where]
                if y is not None:
                    check_targets(y, features.f, likelihood, "data's targets")
                acc.add(features, y, groups, likelihood)
                del features
    del Z0
    reduce_accumulators(acc)  # pass 2 needs the full-data W
    W = acc.symmetrised_W()[0, 0].clone().requires_grad_()
    theta = torch.cat([p.detach().reshape(-1) for p in backend.params])
    theta = theta.to(torch.float64)
    bound = _bound(acc, W, theta, prior_precision, sigma_noise, likelihood, temperature)
    inputs = [locations] if inputs is None else list(inputs)
    wants_z = any(t is locations for t in inputs)
    others = [t for t in inputs if t is not locations]
    (-bound).backward(inputs=[W, *others])
    if wants_z:
        assert W.grad is not None
        grad_W = W.grad.detach()
        before = locations.grad.detach().clone() if locations.grad is not None else None
        if isinstance(gradient_plan, int):
            _data_gradient(
                backend, locations, grad_W, training_data, likelihood, jitter,
                gradient_plan,
            )  # fmt: skip
        else:
            blocked_data_gradient(
                backend, locations, grad_W, training_data, likelihood, jitter,
                gradient_plan,
            )  # fmt: skip
        _reduce_gradient(locations, before)
    return (-bound).detach()


def _gradient_plan(
    sizes: FeatureSizes, M: int, batch: int, budget: int
) -> int | BlockedGradientPlan:
    """Pass 2's plan: the locations' graph held where it fits, else by blocks.

    Returns
    -------
    int or BlockedGradientPlan
        The data chunk with the locations' graph held (:func:`_gradient_chunk`),
        or the plan by blocks of locations (:mod:`._evidence_blocks`).

    Raises
    ------
    MemoryBudgetError
        If not even one location and one input fit, before any work.
    """
    chunk = _gradient_chunk(sizes, M, batch, budget)
    return chunk if chunk else plan_blocked_gradient(sizes, M, batch, budget)


def _reduce_gradient(locations: torch.Tensor, before: torch.Tensor | None) -> None:
    """Sum pass 2's share of ``locations.grad`` over the ranks (distributed).

    It is a sum over data; what ``.grad`` held before is kept once.
    """
    if not is_distributed():
        return
    local = torch.zeros_like(locations) if locations.grad is None else locations.grad
    local = local.detach() - (0 if before is None else before)
    total = reduce_sum(local)
    locations.grad = total if before is None else before + total


def _location_features(
    backend: JacobianBackend, locations: torch.Tensor, chunks: Chunks
) -> BatchFeatures:
    """The locations' features without graph: whole, or in ``chunks``' blocks.

    Returns
    -------
    BatchFeatures
        Held whole, or :class:`._chunks.ChunkedFeatures` (held or recomputed).
    """
    if chunks.whole:
        return batch_features(backend, locations, False)

    def compute(where: slice) -> BatchFeatures:
        return batch_features(backend, locations[where], False)

    n, block = len(locations), chunks.locations
    return ChunkedFeatures(compute, n, block, chunks.hold_locations)


def _gradient_chunk(sizes: FeatureSizes, M: int, batch: int, budget: int) -> int:
    """Data inputs per chunk of pass 2, with the locations' graph held.

    Counted: the locations' features with their graph and their Gram's working
    memory; per chunk of ``c`` inputs, their features while computed, the Gram
    against the locations (kept for the backward pass) and four ``MC × cC``
    matrices (``K``, ``V``, ``VΛ`` and a gradient).

    Returns
    -------
    int
        The largest chunk in ``1..batch`` that fits ``budget`` bytes; 0 if not
        even one input fits beside the locations.
    """
    C = sizes.n_outputs
    held = M * sizes.graph + sizes.gram(M, M)

    def needs(c: int) -> float:
        return held + c * sizes.transient + sizes.gram(M, c) + 32.0 * M * C * c * C

    return largest_fitting(lambda c: needs(c) <= budget, batch)


def _data_gradient(
    backend: JacobianBackend,
    locations: torch.Tensor,
    grad_W: torch.Tensor,
    data: TrainingData,
    likelihood: str,
    jitter: float,
    chunk: int,
) -> None:
    """Pass 2: add ``Σ_batches ⟨∂F/∂W, ∂W_batch/∂Z⟩`` to ``locations.grad``.

    The data in chunks of at most ``chunk`` inputs (:func:`_gradient_chunk`).

    The bound depends on the locations only through ``W = Σ_b V_b Λ_b V_bᵀ``,
    ``V_b = L(Z)⁻¹ K_Zb(Z)`` (the frame ``L(Z)`` included), so this is the whole
    gradient in ``Z``. Under ``torch.distributed`` it is a sum over data and is
    all-reduced; the hyperparameters' gradients see the data only through the
    reduced sums and are already the same on every rank.
    """
    Z = batch_features(backend, locations, True)
    ones = torch.ones((), dtype=torch.float64, device=locations.device)
    L = frame_factor(Z.gram(Z, ones), jitter)
    for xb in data.input_batches():
        xb = xb.to(locations.device)
        for where in slices(len(xb), chunk):
            with torch.no_grad():
                features = batch_features(backend, xb[where], False)
                lam = output_hessians(features.f, likelihood)
            W_b = whitened_sum(L, Z.gram(features, ones), lam)
            (grad_W * W_b).sum().backward(retain_graph=True, inputs=[locations])
            del features, W_b
