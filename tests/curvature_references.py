"""Independent float64 curvature references: exact GGN, EF, KFAC and nearest Kronecker.

Everything here is plain autograd on one sample at a time, as
:func:`tests.references.loop_jacobians` is; nothing imports ``laplace_diffjac``.

* :func:`ggn_full`: ``sum_b J_b^T Lambda_b J_b`` from :func:`loop_jacobians`.
* :func:`exact_ggn`: the GGN diagonal and chosen per-parameter blocks without ever
  forming ``J`` or a ``P x P`` matrix: one backward pass per sample ``b`` and column
  ``s`` of ``S_b`` (``S_b S_b^T = Lambda_b``) gives ``J_b^T s``, whose squares and
  outer products are summed (memory ``O(P)``; ResNet-sized models).
* :func:`ef_diagonal`, :func:`ef_full`: the empirical Fisher from per-sample loss
  gradients, in laplace-torch's convention ``factor * sum_b g_b g_b^T`` with
  ``g_b`` the gradient of the unscaled sum-reduced loss of sample ``b``.
* :func:`kfac_factors`: Kronecker factors of ``nn.Linear``, Hugging Face's
  ``Conv1D``, ``nn.Embedding`` (KFAC-expand and KFAC-reduce of Eschenhagen et al.
  2023, as curvlinops' ``KFACLinearOperator`` defines them) and ``nn.Conv1d/2d/3d``
  with ``groups=1`` (BackPACK's ``KFLR``), from forward hooks that record each such
  module's input and output for one sample at a time and ``torch.autograd.grad`` of
  the seeded output ``s^T f_b`` with respect to the module outputs (the signals).
* :func:`nearest_kronecker_product`: Van Loan and Pitsianis' nearest Kronecker
  product of a block, by a dense SVD of the rearranged block.
* :func:`kron_reference`: one entry per parameter, in the order of ``params``: the
  KFAC factors where :func:`kfac_factors` has a rule, else the exact block for a
  1-D parameter or one whose first dimension is 1, else the nearest Kronecker
  product of the exact block.

Data come as a sequence of batches ``(x, y)``; ``x`` a tensor or a mapping of
tensors sharing the batch dimension. Sums run over all batches; KFAC's input
factors are normalised by the total number of samples ``N`` (curvlinops'
``num_data``), so laplace-torch's per-batch rescaling ``F[1] *= M / N``, summed over
batches of equal size, gives the same product.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from tests.references import loop_jacobians, reference_forward

KFACApprox = Literal["expand", "reduce"]
Batch = tuple[Any, torch.Tensor]


# --- Loss, its Hessian in the outputs and a square root


def loss_and_factor(likelihood: str) -> tuple[nn.Module, float]:
    """laplace-torch's loss and factor for ``likelihood``.

    Parameters
    ----------
    likelihood : {'classification', 'regression'}

    Returns
    -------
    lossfunc : torch.nn.Module
        ``CrossEntropyLoss`` or ``MSELoss``, both sum-reduced.
    factor : float
        1 for classification, 0.5 for regression (the Gaussian log likelihood).

    Raises
    ------
    ValueError
        For another likelihood.

    """
    if likelihood == "classification":
        return nn.CrossEntropyLoss(reduction="sum"), 1.0
    if likelihood == "regression":
        return nn.MSELoss(reduction="sum"), 0.5
    raise ValueError(f"unknown likelihood {likelihood!r}")


def scaled_loss(f: torch.Tensor, y: torch.Tensor, likelihood: str) -> torch.Tensor:
    """``factor * lossfunc(f, y)``: laplace-torch's loss of a batch ``(B, C)``."""
    lossfunc, factor = loss_and_factor(likelihood)
    return factor * lossfunc(f, y)


def output_hessian(f: torch.Tensor, y: torch.Tensor, likelihood: str) -> torch.Tensor:
    """``Lambda``: Hessian of the scaled loss of one sample in its outputs.

    Parameters
    ----------
    f : torch.Tensor
        One sample's outputs ``(C,)``.
    y : torch.Tensor
        Its target: a class index ``()`` or a vector ``(C,)``.
    likelihood : {'classification', 'regression'}

    Returns
    -------
    torch.Tensor
        ``(C, C)``; ``diag(p) - p p^T`` for cross-entropy, the identity for
        ``0.5 * MSELoss(sum)``, here by autograd.

    """
    target = y.reshape(1, *y.shape)
    return torch.autograd.functional.hessian(
        lambda g: scaled_loss(g.unsqueeze(0), target, likelihood), f.detach()
    )


def hessian_square_root(hessian: torch.Tensor) -> torch.Tensor:
    """``S`` with ``S S^T = hessian`` (symmetric PSD), from its eigendecomposition.

    Parameters
    ----------
    hessian : torch.Tensor
        ``(C, C)``.

    Returns
    -------
    torch.Tensor
        ``(C, K)``: the eigenvectors scaled by the roots of their eigenvalues, those
        with eigenvalues at round-off level (cross-entropy's null direction
        ``1``) left out, since they contribute nothing.

    """
    values, vectors = torch.linalg.eigh(hessian)
    eps = torch.finfo(values.dtype).eps
    keep = values > values.abs().max() * hessian.shape[0] * eps
    return vectors[:, keep] * values[keep].sqrt()


# --- Samples


def batch_size(x: Any) -> int:
    """Number of samples of a tensor batch or of a mapping of tensors."""
    if isinstance(x, Mapping):
        return len(next(v for v in x.values() if isinstance(v, torch.Tensor)))
    return len(x)


def sample(x: Any, i: int) -> Any:
    """Sample ``i`` of ``x`` as a batch of one (a mapping stays a mapping)."""
    if isinstance(x, Mapping):
        return {
            k: v[i : i + 1] if isinstance(v, torch.Tensor) else v for k, v in x.items()
        }
    return x[i : i + 1]


def trainable(model: nn.Module) -> list[torch.Tensor]:
    """Parameters with ``requires_grad``, in ``model.parameters()`` order."""
    return [p for p in model.parameters() if p.requires_grad]


def _seeded_outputs(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    hessian_outputs: Sequence[torch.Tensor] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample: its outputs ``f_b (C,)`` in the graph and ``S_b (C, C)``.

    The forward runs under :func:`reference_forward`. ``hessian_outputs`` (one
    ``(B, C)`` per batch) are the outputs at which ``Lambda_b`` is taken, when they
    are not the model's own (laplace-torch's last-layer GGN: ``J`` from the
    features, ``Lambda`` at the network's output).
    """
    with reference_forward(model), torch.enable_grad():
        for k, (x, y) in enumerate(batches):
            for b in range(batch_size(x)):
                f = model(sample(x, b)).reshape(-1)
                at = f if hessian_outputs is None else hessian_outputs[k][b]
                yield f, hessian_square_root(output_hessian(at, y[b], likelihood))


# --- Exact GGN


def ggn_from_jacobians(
    J: torch.Tensor, f: torch.Tensor, y: torch.Tensor, likelihood: str
) -> torch.Tensor:
    """``sum_b J_b^T Lambda_b J_b`` for Jacobians ``(B, C, P)`` and outputs ``(B, C)``.

    Returns
    -------
    torch.Tensor
        ``(P, P)``.

    """
    lam = torch.stack([output_hessian(fb, yb, likelihood) for fb, yb in zip(f, y)])
    return torch.einsum("bcp,bck,bkq->pq", J.detach(), lam, J.detach())


def ggn_full(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    params: Sequence[torch.Tensor] | None = None,
    hessian_outputs: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The exact GGN over ``params`` from :func:`loop_jacobians`.

    Parameters
    ----------
    model : torch.nn.Module
        Called with one sample at a time.
    batches : sequence of (x, y)
        The data.
    likelihood : {'classification', 'regression'}
    params : sequence of torch.Tensor, optional
        Default: the trainable parameters.
    hessian_outputs : sequence of torch.Tensor, optional
        Outputs ``(B, C)`` per batch at which ``Lambda`` is taken (default: the
        model's own outputs).

    Returns
    -------
    torch.Tensor
        ``(P, P)``, summed over all samples.

    """
    chosen = trainable(model) if params is None else list(params)
    total = sum(p.numel() for p in chosen)
    H = torch.zeros(total, total, dtype=chosen[0].dtype)
    for k, (x, y) in enumerate(batches):
        J, f = loop_jacobians(model, x, chosen)
        at = f if hessian_outputs is None else hessian_outputs[k]
        H += ggn_from_jacobians(J, at, y, likelihood)
    return H


def last_layer_features(
    model: nn.Module,
    x: Any,
    last_layer: nn.Module,
    reduction: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input of ``last_layer`` and the model's output, as laplace-torch reads them.

    Parameters
    ----------
    model : torch.nn.Module
        The network.
    x : torch.Tensor or mapping
        A batch.
    last_layer : torch.nn.Module
        A submodule of ``model`` called once per forward.
    reduction : {'pick_first', 'pick_last', 'average'}, optional
        laplace-torch 0.3's ``feature_reduction`` of features with more than two
        dimensions (``(B, T, D)`` -> ``(B, D)``).

    Returns
    -------
    features : torch.Tensor
        ``(B, D)``, detached.
    outputs : torch.Tensor
        The model's output ``(B, C)``, detached: where laplace-torch's last-layer
        GGN takes ``Lambda`` (``J`` is that of ``last_layer`` on ``features``).

    Raises
    ------
    ValueError
        For features of more than two dimensions without a known reduction.

    """
    seen: list[torch.Tensor] = []
    handle = last_layer.register_forward_hook(
        lambda module, args, output: seen.append(args[0].detach())
    )
    try:
        with reference_forward(model), torch.no_grad():
            outputs = model(x)
    finally:
        handle.remove()
    (phi,) = seen
    if phi.ndim > 2:
        tokens = phi.flatten(1, -2)
        if reduction == "pick_first":
            phi = tokens[:, 0]
        elif reduction == "pick_last":
            phi = tokens[:, -1]
        elif reduction == "average":
            phi = tokens.mean(1)
        else:
            raise ValueError(f"features {tuple(phi.shape)} need a reduction")
    return phi, outputs.detach()


@dataclass
class ExactGGN:
    """The exact GGN's diagonal and some of its per-parameter diagonal blocks.

    Attributes
    ----------
    diagonal : torch.Tensor
        ``(P,)`` over all parameters asked for, in their order.
    blocks : dict of int to torch.Tensor
        Parameter index -> its block ``(numel, numel)`` (row-major flattening).

    """

    diagonal: torch.Tensor
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)


def exact_ggn(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    params: Sequence[torch.Tensor] | None = None,
    blocks: Sequence[int] = (),
    hessian_outputs: Sequence[torch.Tensor] | None = None,
) -> ExactGGN:
    """Diagonal and chosen blocks of ``sum_b J_b^T Lambda_b J_b``, never forming ``J``.

    Parameters
    ----------
    model : torch.nn.Module
        Called with one sample at a time.
    batches : sequence of (x, y)
        The data.
    likelihood : {'classification', 'regression'}
    params : sequence of torch.Tensor, optional
        Default: the trainable parameters.
    blocks : sequence of int
        Indices into ``params`` whose diagonal blocks are wanted.
    hessian_outputs : sequence of torch.Tensor, optional
        Outputs ``(B, C)`` per batch at which ``Lambda`` is taken (default: the
        model's own outputs).

    Returns
    -------
    ExactGGN
        One backward pass per sample and column of ``S_b``: ``v = J_b^T s``;
        ``diagonal = sum v**2``, ``blocks[i] = sum v_i v_i^T``.

    """
    chosen = trainable(model) if params is None else list(params)
    return _curvature_pass(
        model, batches, likelihood, chosen, blocks, hessian_outputs=hessian_outputs
    )


# --- Empirical Fisher


def _per_sample_loss_gradients(
    model: nn.Module, batches: Sequence[Batch], likelihood: str, chosen: list
) -> Iterator[torch.Tensor]:
    lossfunc, _ = loss_and_factor(likelihood)
    with reference_forward(model), torch.enable_grad():
        for x, y in batches:
            for b in range(batch_size(x)):
                f = model(sample(x, b))
                loss = lossfunc(f.reshape(1, -1), y[b : b + 1])
                grads = torch.autograd.grad(loss, chosen, allow_unused=True)
                yield torch.cat(
                    [
                        (torch.zeros_like(p) if g is None else g).flatten()
                        for g, p in zip(grads, chosen)
                    ]
                )


def ef_diagonal(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    params: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``factor * sum_b g_b**2``, ``g_b`` the gradient of sample ``b``'s unscaled loss.

    laplace-torch's ``BackPackEF.diag`` (BackPACK's ``SumGradSquared`` of the
    sum-reduced loss, times ``factor``).

    Returns
    -------
    torch.Tensor
        ``(P,)``.

    """
    chosen = trainable(model) if params is None else list(params)
    _, factor = loss_and_factor(likelihood)
    grads = _per_sample_loss_gradients(model, batches, likelihood, chosen)
    return factor * sum(g * g for g in grads)


def ef_full(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    params: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``factor * sum_b g_b g_b^T`` (laplace-torch's ``EFInterface.full``).

    Returns
    -------
    torch.Tensor
        ``(P, P)``.

    """
    chosen = trainable(model) if params is None else list(params)
    _, factor = loss_and_factor(likelihood)
    grads = _per_sample_loss_gradients(model, batches, likelihood, chosen)
    return factor * sum(torch.outer(g, g) for g in grads)


# --- KFAC


def _hf_conv1d() -> type | None:
    """Hugging Face's ``Conv1D`` (GPT-2's Linear, weight ``(in, out)``) or None."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is in the test extra
        return None
    return Conv1D


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def kfac_kind(module: nn.Module) -> str | None:
    """The KFAC rule of a module: 'linear', 'conv1d_hf', 'embedding', 'conv' or None.

    Convolutions count with ``groups=1`` only (depthwise and grouped ones have no
    rule here).
    """
    conv1d_hf = _hf_conv1d()
    if isinstance(module, nn.Linear):
        return "linear"
    if conv1d_hf is not None and isinstance(module, conv1d_hf):
        return "conv1d_hf"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, _CONVOLUTIONS) and module.groups == 1:
        return "conv"
    return None


@dataclass
class _Site:
    """A module with a KFAC rule and the running sums of its two factors."""

    module: nn.Module
    kind: str
    signal: torch.Tensor | None = None  # G (out, out)
    inputs: torch.Tensor | None = None  # A (in, in)
    calls: list = field(default_factory=list)  # (input copy, output) of this sample

    def add(self, name: str, value: torch.Tensor) -> None:
        current = getattr(self, name)
        setattr(self, name, value if current is None else current + value)


def _kfac_sites(model: nn.Module, chosen: list) -> dict[int, tuple[_Site, str]]:
    """Parameter index -> (site, 'weight' or 'bias') for parameters with a rule."""
    index = {id(p): i for i, p in enumerate(chosen)}
    owners: dict[int, tuple[_Site, str]] = {}
    for module in model.modules():
        kind = kfac_kind(module)
        if kind is None:
            continue
        site = _Site(module, kind)
        for role in ("weight", "bias"):
            p = getattr(module, role, None)
            if isinstance(p, torch.Tensor) and id(p) in index:
                if index[id(p)] in owners:
                    raise ValueError("a parameter shared by two modules has no rule")
                owners[index[id(p)]] = (site, role)
    return owners


@contextmanager
def _recorded(sites: list[_Site]) -> Iterator[None]:
    """Forward hooks: each site records (a copy of) its input and its output.

    The hook hands on a clone of the output, so that a later in-place operation
    (``Hardswish(inplace=True)`` after a Linear) changes the clone, not the
    recorded output that the signals are taken at.
    """

    def hook(site: _Site):
        def record(module, args, output):
            site.calls.append((args[0].detach().clone(), output))
            return output.clone()

        return record

    handles = [s.module.register_forward_hook(hook(s)) for s in sites]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _patches(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Unfolded input ``(positions, C_in * prod(kernel))`` of one sample.

    Columns in the row-major order of ``(C_in, *kernel)``, the weight's layout. The
    input is padded first (any ``padding_mode``, string paddings included); 1-D and
    2-D by ``F.unfold``, 3-D by a convolution with one-hot kernels (output channel
    ``j`` reads entry ``j`` of the flattened ``(C_in, *kernel)``).
    """
    kernel = tuple(conv.kernel_size)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    if len(kernel) == 3:
        n = conv.in_channels * prod(kernel)
        eye = torch.eye(n, dtype=x.dtype, device=x.device)
        eye = eye.reshape(n, conv.in_channels, *kernel)
        out = F.conv3d(x, eye, None, conv.stride, 0, conv.dilation)
        return out.reshape(n, -1).T
    if len(kernel) == 1:  # as a 2-D input of height 1
        x, kernel = x.unsqueeze(2), (1, *kernel)
        stride, dilation = (1, *conv.stride), (1, *conv.dilation)
    else:
        stride, dilation = conv.stride, conv.dilation
    return F.unfold(x, kernel, dilation=dilation, stride=stride)[0].T


def _positions(site: _Site, x: torch.Tensor) -> torch.Tensor:
    """A sample's inputs at each weight-sharing position, ``(positions, in)``."""
    if x.shape[0] != 1:
        raise ValueError(f"expected a batch of one, got input {tuple(x.shape)}")
    module = site.module
    if site.kind == "conv":
        return _patches(module, x)
    if site.kind == "embedding":
        if module.max_norm is not None:
            raise ValueError("Embedding(max_norm=...) has no rule here")
        ids = x.reshape(-1)
        a = F.one_hot(ids, module.num_embeddings).to(module.weight.dtype)
        if module.padding_idx is not None:  # that row gets no gradient: input 0
            a[ids == module.padding_idx] = 0
        return a
    return x.reshape(-1, x.shape[-1])


def _signal_positions(site: _Site, g: torch.Tensor) -> torch.Tensor:
    """The signal at each position of the module's output, ``(positions, out)``."""
    if site.kind == "conv":
        return g.reshape(g.shape[1], -1).T
    return g.reshape(-1, g.shape[-1])


def _accumulate(
    site: _Site, signals: list[torch.Tensor], n_data: int, approx: KFACApprox
) -> None:
    """Add one sample's terms to the site's factors.

    ``signals`` holds the gradient of ``s^T f_b`` at the module's output, one per
    column ``s`` of ``S_b``. Linear-like (expand): ``A += sum_t a_t a_t^T / (N T)``,
    ``G += sum_s sum_t g g^T``; (reduce): ``A += mean_t(a) mean_t(a)^T / N``,
    ``G += sum_s (sum_t g)(sum_t g)^T``. Convolutions (BackPACK's KFLR):
    ``A += sum_l a_l a_l^T / N``, ``G += sum_s (sum_l g)(sum_l g)^T``.
    """
    if len(site.calls) != 1:
        raise ValueError(
            f"{type(site.module).__name__} called {len(site.calls)} times in one "
            "sample; the reference has a rule for one call"
        )
    a = _positions(site, site.calls[0][0])
    gs = [_signal_positions(site, g) for g in signals]
    if site.kind == "conv":
        site.add("inputs", a.T @ a / n_data)
        site.add("signal", sum(torch.outer(g.sum(0), g.sum(0)) for g in gs))
    elif approx == "expand":
        site.add("inputs", a.T @ a / (n_data * a.shape[0]))
        site.add("signal", sum(g.T @ g for g in gs))
    elif approx == "reduce":
        mean = a.mean(0)
        site.add("inputs", torch.outer(mean, mean) / n_data)
        site.add("signal", sum(torch.outer(g.sum(0), g.sum(0)) for g in gs))
    else:
        raise ValueError(f"unknown kfac_approx {approx!r}")


def _layout(site: _Site, role: str) -> list[torch.Tensor]:
    """Factors in the parameter's row-major layout (``F0 (m, m), F1 (n, n)``)."""
    G, A = site.signal, site.inputs
    if G is None or A is None:
        raise ValueError(f"{type(site.module).__name__} was never called")
    if role == "bias":
        return [G]
    if site.kind in ("conv1d_hf", "embedding"):  # weight (in, out) / (vocab, D)
        return [A, G]
    return [G, A]  # weight (out, in) / (out, in, *kernel)


def kfac_factors(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    params: Sequence[torch.Tensor] | None = None,
    kfac_approx: KFACApprox = "expand",
) -> dict[int, list[torch.Tensor]]:
    """KFAC factors of the parameters that have a rule, from per-sample autograd.

    Parameters
    ----------
    model : torch.nn.Module
        Called with one sample at a time; each module with a rule is called once
        per sample, batch dimension first.
    batches : sequence of (x, y)
        The data; ``N`` is their total number of samples.
    likelihood : {'classification', 'regression'}
    params : sequence of torch.Tensor, optional
        Default: the trainable parameters.
    kfac_approx : {'expand', 'reduce'}
        For Linear-like layers shared over positions (tokens); convolutions get
        BackPACK's ``KFLR`` either way.

    Returns
    -------
    dict of int to list of torch.Tensor
        Parameter index -> factors: ``[G (out, out), A (in, in)]`` for
        ``nn.Linear`` and convolution weights, ``[A (in, in), G (out, out)]`` for
        ``Conv1D`` (weight ``(in, out)``) and ``nn.Embedding`` (``A`` over the
        vocabulary: one-hot inputs, zero at ``padding_idx``), ``[G]`` for biases
        (weights with input 1). ``G`` sums over samples, ``A`` averages over the
        ``N`` samples (and, expand, over the positions).

    """
    chosen = trainable(model) if params is None else list(params)
    owners = _kfac_sites(model, chosen)
    sites = list({id(s): s for s, _ in owners.values()}.values())
    _curvature_pass(model, batches, likelihood, chosen, (), sites, kfac_approx)
    return {i: _layout(site, role) for i, (site, role) in owners.items()}


def _curvature_pass(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    chosen: list[torch.Tensor],
    blocks: Sequence[int] = (),
    sites: Sequence[_Site] = (),
    kfac_approx: KFACApprox = "expand",
    hessian_outputs: Sequence[torch.Tensor] | None = None,
) -> ExactGGN:
    """One pass over the samples for :func:`exact_ggn` and :func:`kfac_factors`.

    Per sample ``b`` and column ``s`` of ``S_b``, one ``torch.autograd.grad`` of
    ``s^T f_b`` with respect to the recorded outputs of ``sites`` (their signals,
    added to their factors) and to ``chosen`` (``J_b^T s``: the diagonal and the
    ``blocks``).
    """
    diag = [torch.zeros(p.numel(), dtype=p.dtype) for p in chosen]
    columns: dict[int, list[torch.Tensor]] = {i: [] for i in blocks}
    n_data = sum(batch_size(x) for x, _ in batches)
    with _recorded(list(sites)):
        for f, S in _seeded_outputs(model, batches, likelihood, hessian_outputs):
            called = [site for site in sites if site.calls]
            outputs = [site.calls[0][1] for site in called]
            signals: list[list[torch.Tensor]] = [[] for _ in called]
            for k in range(S.shape[1]):
                grads = torch.autograd.grad(
                    f @ S[:, k],
                    [*outputs, *chosen],
                    retain_graph=True,
                    allow_unused=True,
                )
                for j, g in enumerate(grads[: len(outputs)]):
                    signals[j].append(
                        torch.zeros_like(outputs[j]) if g is None else g.detach()
                    )
                for i, g in enumerate(grads[len(outputs) :]):
                    if g is not None:
                        v = g.detach().flatten()
                        diag[i] += v * v
                        if i in columns:
                            columns[i].append(v)
            for site, site_signals in zip(called, signals):
                _accumulate(site, site_signals, n_data, kfac_approx)
            for site in sites:
                site.calls.clear()
    result = ExactGGN(torch.cat(diag))
    for i, vs in columns.items():
        V = torch.stack(vs) if vs else chosen[i].new_zeros(0, chosen[i].numel())
        result.blocks[i] = V.T @ V
    return result


# --- Nearest Kronecker product and the per-parameter reference


def nearest_kronecker_product(
    block: torch.Tensor, m: int, n: int
) -> list[torch.Tensor]:
    """``[F0 (m, m), F1 (n, n)]`` minimising ``||block - F0 kron F1||_F``.

    Van Loan and Pitsianis (1993): the rank-1 truncated SVD ``sigma u v^T`` of the
    rearranged block ``R[(a, c), (b, d)] = block[(a, b), (c, d)]`` gives
    ``F0 = sqrt(sigma) u``, ``F1 = sqrt(sigma) v`` (reshaped); the sign is chosen so
    that ``trace(F0) >= 0``.

    Parameters
    ----------
    block : torch.Tensor
        ``(m n, m n)``, rows and columns in row-major ``(m, n)`` order.
    m, n : int
        The two factors' sizes.

    Returns
    -------
    list of torch.Tensor
        ``[F0, F1]``.

    """
    R = block.reshape(m, n, m, n).permute(0, 2, 1, 3).reshape(m * m, n * n)
    u, sigma, v = _top_singular_triplet(R)
    F0 = (sigma.sqrt() * u).reshape(m, m)
    F1 = (sigma.sqrt() * v).reshape(n, n)
    if F0.trace() < 0:
        F0, F1 = -F0, -F1
    return [F0, F1]


def _top_singular_triplet(
    R: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(u, sigma, v)`` of the largest singular value of ``R``.

    From the eigendecomposition of the Gram matrix of ``R``'s shorter side
    (``R^T R`` or ``R R^T``), the other vector as ``R v / sigma``: the same triplet
    as ``torch.linalg.svd`` to round-off when the top singular value is separated,
    several times faster for the tall rearranged blocks of depthwise convolutions.
    """
    if R.shape[0] < R.shape[1]:
        v, sigma, u = _top_singular_triplet(R.T)
        return u, sigma, v
    values, vectors = torch.linalg.eigh(R.T @ R)
    v = vectors[:, -1]
    sigma = values[-1].clamp(min=0).sqrt()
    if sigma == 0:  # a zero block: F0 = F1 = 0
        return R.new_zeros(R.shape[0]), sigma, v
    return R @ v / sigma, sigma, v


def kron_reference(
    model: nn.Module,
    batches: Sequence[Batch],
    likelihood: str,
    params: Sequence[torch.Tensor] | None = None,
    kfac_approx: KFACApprox = "expand",
    hessian_outputs: Sequence[torch.Tensor] | None = None,
) -> list[list[torch.Tensor]]:
    """What each parameter's ``Kron`` block must equal (as a product), in order.

    Parameters
    ----------
    model : torch.nn.Module
        Called with one sample at a time.
    batches : sequence of (x, y)
        The data.
    likelihood : {'classification', 'regression'}
    params : sequence of torch.Tensor, optional
        Default: the trainable parameters (``model.parameters()`` order).
    kfac_approx : {'expand', 'reduce'}
        See :func:`kfac_factors`.
    hessian_outputs : sequence of torch.Tensor, optional
        Outputs ``(B, C)`` per batch at which ``Lambda`` is taken (default: the
        model's own outputs).

    Returns
    -------
    list of list of torch.Tensor
        Per parameter: the KFAC factors where :func:`kfac_factors` has a rule;
        else ``[block]``, the exact GGN block, for a 1-D parameter or one of shape
        ``(1, ...)``; else the nearest Kronecker product of the exact block.

    """
    chosen = trainable(model) if params is None else list(params)
    owners = _kfac_sites(model, chosen)
    sites = list({id(s): s for s, _ in owners.values()}.values())
    others = [i for i in range(len(chosen)) if i not in owners]
    exact = _curvature_pass(
        model, batches, likelihood, chosen, others, sites, kfac_approx, hessian_outputs
    )
    result: list[list[torch.Tensor]] = []
    for i, p in enumerate(chosen):
        if i in owners:
            result.append(_layout(*owners[i]))
        elif p.ndim <= 1 or p.shape[0] == 1:
            result.append([exact.blocks[i]])
        else:
            m = p.shape[0]
            result.append(nearest_kronecker_product(exact.blocks[i], m, p.numel() // m))
    return result


# --- Comparing Kronecker products

#: Largest product formed densely when comparing (entries per side).
DENSE_LIMIT = 4096


def kron_product(factors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The dense block ``F0 kron F1`` (or ``F0``) of one parameter."""
    mats = [f if f.ndim > 1 else torch.diag(f) for f in factors]
    if len(mats) == 1:
        return mats[0]
    return torch.kron(mats[0], mats[1])


def _close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, what: str
) -> None:
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
    )


def _largest_entry(factors: Sequence[torch.Tensor]) -> float:
    """The largest absolute entry of ``F0 kron F1`` (the product of the factors')."""
    return prod(f.abs().max().item() for f in factors)


def assert_kron_block_close(
    actual: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    rtol: float,
    what: str = "",
    floor: float = 0.0,
) -> None:
    """Assert ``prod(actual) == prod(expected)`` (Kronecker products of factors).

    Small blocks are compared densely; two-factor blocks above
    :data:`DENSE_LIMIT` factor by factor after moving the scale: with
    ``alpha = <F0, E0> / <E0, E0>``, ``F0 = alpha E0`` and ``alpha F1 = E1``, which
    holds exactly when the products agree. Entries are compared with ``rtol`` and
    an absolute tolerance of ``rtol`` times the largest expected entry, or times
    ``floor`` if that is larger (a block that vanishes in exact arithmetic, such as
    the GGN of an attention key's bias, holds round-off only).
    """
    sizes = [f.shape[0] for f in expected]
    atol = rtol * max(_largest_entry(expected), floor)
    if prod(sizes) <= DENSE_LIMIT or len(expected) == 1:
        _close(kron_product(actual), kron_product(expected), rtol, atol, what)
        return
    assert len(actual) == 2, f"{what}: {len(actual)} factors, expected 2"
    E0, E1 = expected
    A0, A1 = actual
    alpha = (A0 * E0).sum() / (E0 * E0).sum()
    scale0, scale1 = E0.abs().max().item(), E1.abs().max().item()
    _close(A0, alpha * E0, rtol, atol / scale1, f"{what} (F0, scale {alpha:.3g})")
    _close(alpha * A1, E1, rtol, atol / scale0, f"{what} (F1, scale {alpha:.3g})")


def assert_kron_close(
    actual: Sequence[Sequence[torch.Tensor]],
    expected: Sequence[Sequence[torch.Tensor]],
    rtol: float,
    names: Sequence[str] | None = None,
    relative_floor: float = 1e-8,
) -> None:
    """:func:`assert_kron_block_close` for every parameter's block, in order.

    Blocks are compared relative to their own largest entry, but never tighter
    than ``relative_floor`` times the largest entry of all blocks.
    """
    assert len(actual) == len(expected), (len(actual), len(expected))
    floor = relative_floor * max(_largest_entry(e) for e in expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        what = f"block {i}" + (f" ({names[i]})" if names is not None else "")
        assert_kron_block_close(list(a), list(e), rtol, what, floor)
