"""What ``ContextPosterior.fit`` keeps of the data: whitened sums, never the data.

With the Jacobians ``J_Z`` ``(M, C, P)`` at the locations, parameter groups
``g`` (:class:`._hyperparameters.PriorGroups`) with fixed weights ``w`` and the
unscaled likelihood Hessians ``Λ̃ₙ`` (without ``1 / (σ² T)``), the statistics are
kept in the *frame* of the unscaled locations' Gram ``K⁰ = Σ_g K_ZZ^g``::

    K_ZZ^g  = J_Z^g diag(w^g) J_Z^gᵀ                               (G, MC, MC)
    L₀ L₀ᵀ  = K⁰ + ε₀ I,   ε₀ = jitter · mean diag K⁰               (MC, MC)
    W^{gh}  = Σₙ Vₙ^g Λ̃ₙ Vₙ^hᵀ,   Vₙ^g = L₀⁻¹ K_Zn^g,
              K_Zn^g = J_Z^g diag(w^g) Jₙ^gᵀ                        (G, G, MC, MC)
    d       = Σₙ diag(Jₙᵀ Λ̃ₙ Jₙ)                                   (P,)
    loss    = Σₙ ½‖yₙ − f(xₙ)‖² (regression) or Σₙ −log softmax(f(xₙ))_{yₙ}

The locations' Jacobians are whitened once, ``G = L₀⁻¹ J_Z diag(w)`` ``(MC, P)``,
so a batch's ``Vₙ^g = G^g Jₙ^gᵀ`` costs one product, as ``K_Zn`` did.
Every batch is whitened before it is added (the sparse-GP form of GPflow's SGPR),
so the sums are well scaled and do not depend on how the data is batched; the
unwhitened ``K_ZX Λ K_XZ``, whose rounding a later whitening would amplify by the
condition number of ``K_ZZ``, is never formed. For group prior variances ``s_g``
the posterior needs ``K_ZZ(s) = Σ_g s_g K_ZZ^g`` and ``K_ZX Λ̃ K_XZ =
L₀ (Σ_{g,h} s_g s_h W^{gh}) L₀ᵀ``, both exact for every ``s``; with one group
(a scalar prior) ``K_ZZ(s) + ε(s) I = s L₀ L₀ᵀ`` and the whitened matrix is just
``s h W`` (:mod:`._evidence`). The trace term of the evidence needs
``Σₙ tr(Λ̃ₙ kₙₙ) = Σ_p Σ₀_p d_p``, exact for every per-parameter ``Σ₀``. All sums
are additive over data, so ``update`` adds a batch without touching the old
data; ``σ²`` and ``T`` are applied later, so changing them after ``fit`` is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...data import is_distributed, reduce_sum
from ...kernels import output_hessians
from ._hyperparameters import PriorGroups

__all__ = [
    "Accumulators",
    "frame_factor",
    "likelihood_gradient",
    "reduce_accumulators",
]


def likelihood_gradient(
    f: torch.Tensor, y: torch.Tensor, likelihood: str
) -> torch.Tensor:
    """``g̃ = ∂ log p(y | f) / ∂f`` without ``1 / (σ² T)``, ``(b, C)`` float64.

    Regression ``y − f``; classification ``onehot(y) − softmax(f)`` (or class
    probabilities ``y − softmax(f)``).

    Returns
    -------
    torch.Tensor
        ``(b, C)``.
    """
    if likelihood == "regression":
        return y.reshape(f.shape).to(f) - f
    if y.shape == f.shape and y.is_floating_point():
        target = y.to(f)
    else:
        target = F.one_hot(y.reshape(-1).long(), f.shape[1]).to(f)
    return target - f.softmax(-1)


def frame_factor(K0: torch.Tensor, jitter: float) -> torch.Tensor:
    """``L₀`` with ``L₀ L₀ᵀ = K⁰ + ε₀ I``, ``ε₀ = jitter · mean diag K⁰`` (float64).

    Parameters
    ----------
    K0 : torch.Tensor
        ``(MC, MC)`` unscaled Gram of the locations.
    jitter : float
        Relative jitter.

    Returns
    -------
    torch.Tensor
        Lower-triangular ``(MC, MC)``.

    Raises
    ------
    torch.linalg.LinAlgError
        If ``K⁰ + ε₀ I`` is not positive definite (``jitter=0`` with more
        location outputs than the kernel's rank); the message names the fix.

    """
    K = 0.5 * (K0 + K0.mT)
    eps = jitter * K.diagonal().mean().clamp_min(torch.finfo(K.dtype).tiny)
    eye = torch.eye(K.shape[0], dtype=K.dtype, device=K.device)
    L, info = torch.linalg.cholesky_ex(K + eps * eye)
    if bool(info.ne(0).any()):
        raise torch.linalg.LinAlgError(
            f"The locations' Gram K_ZZ ({K.shape[0]} location outputs) is singular "
            f"with jitter={jitter:g}: pass a positive relative jitter (the default "
            "1e-8) or fewer locations."
        )
    return L


@dataclass
class Accumulators:
    """Whitened sums over the training data, in float64; see the module docstring.

    Attributes
    ----------
    G : torch.Tensor
        ``(M, C, P)`` the locations' whitened, weighted Jacobians
        ``L₀⁻¹ J_Z diag(w)`` (rows ordered as ``J_Z``'s ``(m, c)``), so that
        ``L₀⁻¹ K_Zb^g = G^g J_b^gᵀ`` needs no copy of a batch's Jacobians.
    sqrt_w : torch.Tensor
        ``(P,)`` the groups' fixed weights' square roots.
    bounds : tuple of (int, int)
        The prior groups' column ranges.
    K_diag : torch.Tensor
        ``(G, MC)`` diagonals of the unscaled group Grams ``K_ZZ^g``.
    L0 : torch.Tensor
        ``(MC, MC)`` the frame's Cholesky factor.
    jitter : float
        The frame's relative jitter.
    W : torch.Tensor
        ``(G, G, MC, MC)`` whitened sums.
    u : torch.Tensor
        ``(G, MC)`` whitened first-order sums ``Σₙ Vₙ^g r̃ₙ`` of the dual mean,
        ``r̃ₙ = Λ̃ₙ Jₙ (θ* − μ₀) + g̃ₙ`` with ``g̃ₙ`` the likelihood's gradient in
        ``f`` without ``1 / (σ² T)`` (:mod:`._dual_mean`); zero without targets.
    ggn_diag : torch.Tensor
        ``(P,)``.
    loss : torch.Tensor
        ``()``; meaningful only if ``has_targets``.
    n_data : int
        Number of points accumulated.
    has_targets : bool
        Whether every batch had targets (the evidence needs them).
    offset : torch.Tensor or None
        ``(P,)`` the ``θ* − μ₀`` of ``u``, or ``None`` if ``u`` was not kept.

    """

    G: torch.Tensor
    sqrt_w: torch.Tensor
    bounds: tuple[tuple[int, int], ...]
    K_diag: torch.Tensor
    L0: torch.Tensor
    jitter: float
    W: torch.Tensor
    u: torch.Tensor
    ggn_diag: torch.Tensor
    loss: torch.Tensor = field(
        default_factory=lambda: torch.zeros((), dtype=torch.float64)
    )
    n_data: int = 0
    has_targets: bool = True
    offset: torch.Tensor | None = None

    @staticmethod
    def empty(J_z: torch.Tensor, groups: PriorGroups, jitter: float) -> Accumulators:
        """Zero sums for locations with Jacobians ``J_z`` ``(M, C, P)`` (float64).

        Returns
        -------
        Accumulators

        Raises
        ------
        torch.linalg.LinAlgError
            As :func:`frame_factor`.

        """
        M, C, P = J_z.shape
        sqrt_w = groups.weight.to(J_z).sqrt()
        Jw = (J_z * sqrt_w).reshape(M * C, P)
        K_diag = torch.stack([Jw[:, a:b].square().sum(1) for a, b in groups.bounds])
        L0 = frame_factor(Jw @ Jw.T, jitter)
        G_ = torch.linalg.solve_triangular(L0, Jw * sqrt_w, upper=False)
        G_ = G_.reshape(M, C, P)
        zeros = J_z.new_zeros
        n_groups = len(groups.bounds)
        return Accumulators(
            G=G_,
            sqrt_w=sqrt_w,
            bounds=tuple(groups.bounds),
            K_diag=K_diag,
            L0=L0,
            jitter=float(jitter),
            W=zeros(n_groups, n_groups, M * C, M * C),
            u=zeros(n_groups, M * C),
            ggn_diag=zeros(P),
            loss=zeros(()),
        )

    @property
    def n_outputs(self) -> int:
        """``C``."""
        return int(self.G.shape[1])

    def zeros_like(self) -> Accumulators:
        """Zero data sums in the same frame (everything of the locations shared)."""
        return Accumulators(
            G=self.G,
            sqrt_w=self.sqrt_w,
            bounds=self.bounds,
            K_diag=self.K_diag,
            L0=self.L0,
            jitter=self.jitter,
            W=torch.zeros_like(self.W),
            u=torch.zeros_like(self.u),
            offset=self.offset,
            ggn_diag=torch.zeros_like(self.ggn_diag),
            loss=torch.zeros_like(self.loss),
        )

    def merge(self, other: Accumulators) -> None:
        """Add the data sums of ``other`` (same frame and groups), in place."""
        self.W = self.W + other.W
        self.u = self.u + other.u
        self.ggn_diag = self.ggn_diag + other.ggn_diag
        self.loss = self.loss + other.loss.to(self.loss)
        self.n_data += other.n_data
        self.has_targets = self.has_targets and other.has_targets

    def whitened(self, Js: torch.Tensor, scales: torch.Tensor | None = None) -> list:
        """``L₀⁻¹ K_Zb^g`` ``(MC, b C)`` per group for Jacobians ``Js`` ``(b, C, P)``.

        Returns
        -------
        list of torch.Tensor
            One per group, or with ``scales`` ``(G,)`` the one matrix
            ``Σ_g scales_g L₀⁻¹ K_Zb^g``.
        """
        G_ = self.G.reshape(-1, self.G.shape[-1])
        J2 = Js.reshape(-1, Js.shape[-1])
        parts = [G_[:, a:b] @ J2[:, a:b].T for a, b in self.bounds]
        if scales is None:
            return parts
        return [sum(s * V for s, V in zip(scales, parts))]

    def group_grams(self) -> torch.Tensor:
        """``L₀⁻¹ K_ZZ^g L₀⁻ᵀ`` ``(G, MC, MC)`` from the whitened Jacobians (PSD)."""
        G_ = self.G.reshape(-1, self.G.shape[-1]) / self.sqrt_w
        return torch.stack([G_[:, a:b] @ G_[:, a:b].T for a, b in self.bounds])

    def add(
        self,
        Js: torch.Tensor,
        f: torch.Tensor,
        y: torch.Tensor | None,
        groups: PriorGroups,
        likelihood: str,
        offset: torch.Tensor | None = None,
    ) -> None:
        """Add one batch: Jacobians ``(b, C, P)``, outputs ``(b, C)``, targets.

        ``offset`` ``(P,)`` is ``θ* − μ₀`` for the dual mean's sums ``u`` (not
        kept without it or without targets).
        """
        Js, f = Js.to(torch.float64), f.to(torch.float64)
        lam = output_hessians(f, likelihood)  # (b, C, C), without 1 / (σ² T)
        MC = self.L0.shape[0]
        Vs = self.whitened(Js)
        VL = [
            torch.einsum("kbc,bce->kbe", V.reshape(MC, *f.shape), lam).reshape(MC, -1)
            for V in Vs
        ]
        for g, V in enumerate(Vs):
            for h, U in enumerate(VL):
                self.W[g, h] += V @ U.T
        self.ggn_diag += (Js * torch.einsum("bce,bep->bcp", lam, Js)).sum((0, 1))
        self.n_data += f.shape[0]
        if y is None:  # checked by the data pass (data.check_targets) otherwise
            self.has_targets = False  # the posterior needs none; the evidence does
            return
        y = y.to(f.device)
        if likelihood == "regression":
            self.loss += 0.5 * (y.reshape(f.shape).to(f) - f).square().sum()
        else:
            y = y.to(f) if y.shape == f.shape else y.reshape(-1).long()
            self.loss += F.cross_entropy(f, y, reduction="sum")
        if offset is not None:
            self.offset = offset.detach().to(torch.float64)
            grad = likelihood_gradient(f, y, likelihood)
            r = torch.einsum("bce,be->bc", lam, Js @ offset.to(Js)) + grad
            for k, V in enumerate(Vs):
                self.u[k] += V @ r.reshape(-1)

    def symmetrised_W(self) -> torch.Tensor:
        """``W`` with each ``(g, h)`` block pair made exactly symmetric."""
        return 0.5 * (self.W + self.W.permute(1, 0, 3, 2))

    def to_state(self) -> dict[str, torch.Tensor | int | bool | float | list | None]:
        """Tensors and plain values only, for ``torch.load(weights_only=True)``."""
        return {
            "G": self.G,
            "sqrt_w": self.sqrt_w,
            "bounds": [list(b) for b in self.bounds],
            "K_diag": self.K_diag,
            "L0": self.L0,
            "jitter": self.jitter,
            "W": self.W,
            "u": self.u,
            "ggn_diag": self.ggn_diag,
            "loss": self.loss,
            "n_data": self.n_data,
            "has_targets": self.has_targets,
            "offset": self.offset,
        }

    @staticmethod
    def from_state(state: dict, groups: PriorGroups, jitter: float) -> Accumulators:
        """Inverse of :meth:`to_state`; also reads the unwhitened sums of 0.1.0.

        A 0.1.0 state holds ``J_Z`` and ``B^{gh} = Σₙ K_Zn^g Λ̃ₙ K_nZ^h`` instead
        of ``G`` and ``W``; it is whitened once here (``W = L₀⁻¹ B L₀⁻ᵀ``, with
        the rounding of that form; fit again for batch-independent sums).

        Parameters
        ----------
        state : dict
            From :meth:`to_state`.
        groups : PriorGroups
            The posterior's prior groups (for a 0.1.0 state).
        jitter : float
            The posterior's relative jitter (for a 0.1.0 state's frame).

        Returns
        -------
        Accumulators

        """
        common = dict(
            ggn_diag=state["ggn_diag"],
            loss=state["loss"],
            n_data=int(state["n_data"]),
            has_targets=bool(state["has_targets"]),
        )
        if "W" in state:
            return Accumulators(
                G=state["G"],
                sqrt_w=state["sqrt_w"],
                bounds=tuple(tuple(b) for b in state["bounds"]),
                K_diag=state["K_diag"],
                L0=state["L0"],
                jitter=float(state["jitter"]),
                W=state["W"],
                u=state["u"],
                offset=state["offset"],
                **common,
            )
        acc = Accumulators.empty(state["J_z"], groups, jitter)
        W = torch.linalg.solve_triangular(acc.L0, state["B"], upper=False)
        acc.W = torch.linalg.solve_triangular(acc.L0, W.mT, upper=False).mT
        for key, value in common.items():
            setattr(acc, key, value)
        return acc


def reduce_accumulators(acc: Accumulators) -> None:
    """Sum ``acc``'s data sums over the ranks, in place (one ``all_reduce``).

    ``W``, ``u``, the GGN diagonal, the loss, ``N`` and the count of ranks without
    targets are packed into one float64 buffer; the counts stay exact below
    ``2⁵³``. ``G``, ``K_diag`` and ``L0`` do not depend on the data and are the
    same on every rank.

    Parameters
    ----------
    acc : Accumulators
        This rank's sums; on return the sums over all shards.

    """
    if not is_distributed():
        return
    counts = [float(acc.n_data), 0.0 if acc.has_targets else 1.0]
    flat = torch.cat(
        [
            acc.W.reshape(-1),
            acc.u.reshape(-1),
            acc.ggn_diag,
            acc.loss.reshape(1).to(acc.W),
            torch.tensor(counts, dtype=acc.W.dtype, device=acc.W.device),
        ]
    )
    flat = reduce_sum(flat)
    n_w, n_u, n_d = acc.W.numel(), acc.u.numel(), acc.ggn_diag.numel()
    acc.W = flat[:n_w].reshape(acc.W.shape).clone()
    acc.u = flat[n_w : n_w + n_u].reshape(acc.u.shape).clone()
    acc.ggn_diag = flat[n_w + n_u : n_w + n_u + n_d].clone()
    acc.loss = flat[n_w + n_u + n_d].clone()
    acc.n_data = int(round(float(flat[-2])))
    acc.has_targets = float(flat[-1]) == 0.0
