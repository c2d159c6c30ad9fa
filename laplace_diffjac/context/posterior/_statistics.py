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

A batch's ``Vₙ^g`` is its Gram with the locations, solved against ``L₀``. With a
backend that hands out per-layer factors (``DiffBackPackGGN``, ``DiffBackPackEF``)
the Grams, ``d`` and the dual mean's ``Jₙ δ`` come from the factors
(:mod:`._features`): neither ``J_Z`` nor a batch's ``Jₙ`` is formed, and what is
kept of the locations is their factors, ``L₀`` and the whitened group Grams
``C^g = L₀⁻¹ K_ZZ^g L₀⁻ᵀ`` ``(G, MC, MC)``; other backends keep ``J_Z``.
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
from ._features import BatchFeatures, JacobianBatch
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
    locations : BatchFeatures
        The locations' outputs and Jacobians: per-layer factors (``J_Z`` is never
        formed) or ``J_Z`` ``(M, C, P)`` for backends without factors.
    weight : torch.Tensor
        ``(P,)`` the groups' fixed weights ``w``.
    bounds : tuple of (int, int)
        The prior groups' column ranges.
    K_diag : torch.Tensor
        ``(G, MC)`` diagonals of the unscaled group Grams ``K_ZZ^g``.
    L0 : torch.Tensor
        ``(MC, MC)`` the frame's Cholesky factor.
    jitter : float
        The frame's relative jitter.
    C : torch.Tensor
        ``(G, MC, MC)`` the whitened group Grams ``L₀⁻¹ K_ZZ^g L₀⁻ᵀ`` (PSD).
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

    locations: BatchFeatures
    weight: torch.Tensor
    bounds: tuple[tuple[int, int], ...]
    K_diag: torch.Tensor
    L0: torch.Tensor
    jitter: float
    C: torch.Tensor
    W: torch.Tensor
    u: torch.Tensor
    ggn_diag: torch.Tensor
    loss: torch.Tensor = field(
        default_factory=lambda: torch.zeros((), dtype=torch.float64)
    )
    n_data: int = 0
    has_targets: bool = True
    offset: torch.Tensor | None = None
    _jacobian_locations: BatchFeatures | None = field(default=None, repr=False)

    @staticmethod
    def empty(
        locations: BatchFeatures, groups: PriorGroups, jitter: float
    ) -> Accumulators:
        """Zero sums for the locations' features (detached, float64).

        Returns
        -------
        Accumulators

        Raises
        ------
        torch.linalg.LinAlgError
            As :func:`frame_factor`.

        """
        weight = groups.weight.to(device=locations.f.device, dtype=torch.float64)
        grams = [locations.gram(locations, weight, b) for b in groups.bounds]
        K_diag = torch.stack([K.diagonal() for K in grams])
        L0 = frame_factor(torch.stack(grams).sum(0), jitter)
        C = torch.stack([_whiten_both(L0, K) for K in grams])
        MC, n_groups, P = L0.shape[0], len(groups.bounds), weight.numel()
        zeros = L0.new_zeros
        return Accumulators(
            locations=locations,
            weight=weight,
            bounds=tuple(groups.bounds),
            K_diag=K_diag,
            L0=L0,
            jitter=float(jitter),
            C=C,
            W=zeros(n_groups, n_groups, MC, MC),
            u=zeros(n_groups, MC),
            ggn_diag=zeros(P),
            loss=zeros(()),
        )

    @property
    def n_outputs(self) -> int:
        """``C``."""
        return self.locations.n_outputs

    def zeros_like(self) -> Accumulators:
        """Zero data sums in the same frame (everything of the locations shared)."""
        return Accumulators(
            locations=self.locations,
            weight=self.weight,
            bounds=self.bounds,
            K_diag=self.K_diag,
            L0=self.L0,
            jitter=self.jitter,
            C=self.C,
            W=torch.zeros_like(self.W),
            u=torch.zeros_like(self.u),
            offset=self.offset,
            ggn_diag=torch.zeros_like(self.ggn_diag),
            loss=torch.zeros_like(self.loss),
            _jacobian_locations=self._jacobian_locations,
        )

    def merge(self, other: Accumulators) -> None:
        """Add the data sums of ``other`` (same frame and groups), in place."""
        self.W = self.W + other.W
        self.u = self.u + other.u
        self.ggn_diag = self.ggn_diag + other.ggn_diag
        self.loss = self.loss + other.loss.to(self.loss)
        self.n_data += other.n_data
        self.has_targets = self.has_targets and other.has_targets

    def _locations_like(self, batch: BatchFeatures) -> BatchFeatures:
        """The locations' features of ``batch``'s kind (``J_Z`` formed once if not)."""
        if batch.kind is self.locations.kind:
            return self.locations
        if self._jacobian_locations is None:
            self._jacobian_locations = self.locations.as_jacobians()
        return self._jacobian_locations

    def whitened(
        self, batch: BatchFeatures, scales: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """``L₀⁻¹ K_Zb^g`` ``(MC, b C)`` per group for a batch's features.

        Returns
        -------
        list of torch.Tensor
            One per group, or with ``scales`` ``(G,)`` the one matrix
            ``Σ_g scales_g L₀⁻¹ K_Zb^g``.
        """
        Z = self._locations_like(batch)
        if scales is None:
            grams = [Z.gram(batch, self.weight, b) for b in self.bounds]
        else:
            var = self.weight.clone()
            for s, (a, b) in zip(scales.to(var), self.bounds):
                var[a:b] = var[a:b] * s
            grams = [Z.gram(batch, var)]
        return [torch.linalg.solve_triangular(self.L0, K, upper=False) for K in grams]

    def group_grams(self) -> torch.Tensor:
        """``L₀⁻¹ K_ZZ^g L₀⁻ᵀ`` ``(G, MC, MC)`` (PSD)."""
        return self.C

    def add(
        self,
        batch: BatchFeatures,
        y: torch.Tensor | None,
        groups: PriorGroups,
        likelihood: str,
        offset: torch.Tensor | None = None,
    ) -> None:
        """Add one batch: its features (outputs ``(b, C)`` and Jacobians), targets.

        ``offset`` ``(P,)`` is ``θ* − μ₀`` for the dual mean's sums ``u`` (not
        kept without it or without targets).
        """
        f = batch.f
        lam = output_hessians(f, likelihood)  # (b, C, C), without 1 / (σ² T)
        MC = self.L0.shape[0]
        Vs = self.whitened(batch)
        VL = [
            torch.einsum("kbc,bce->kbe", V.reshape(MC, *f.shape), lam).reshape(MC, -1)
            for V in Vs
        ]
        for g, V in enumerate(Vs):
            for h, U in enumerate(VL):
                self.W[g, h] += V @ U.T
        self.ggn_diag += batch.ggn_diagonal(lam)
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
            r = torch.einsum("bce,be->bc", lam, batch.jvp(self.offset)) + grad
            for k, V in enumerate(Vs):
                self.u[k] += V @ r.reshape(-1)

    def symmetrised_W(self) -> torch.Tensor:
        """``W`` with each ``(g, h)`` block pair made exactly symmetric."""
        return 0.5 * (self.W + self.W.permute(1, 0, 3, 2))

    def to_state(self) -> dict[str, torch.Tensor | int | bool | float | list | None]:
        """Tensors and plain values only, for ``torch.load(weights_only=True)``.

        The locations' features are not kept: they are the model's, at the
        state's locations, and are computed again on loading.

        Returns
        -------
        dict
        """
        return {
            "weight": self.weight,
            "bounds": [list(b) for b in self.bounds],
            "K_diag": self.K_diag,
            "L0": self.L0,
            "jitter": self.jitter,
            "C": self.C,
            "W": self.W,
            "u": self.u,
            "ggn_diag": self.ggn_diag,
            "loss": self.loss,
            "n_data": self.n_data,
            "has_targets": self.has_targets,
            "offset": self.offset,
        }

    @staticmethod
    def from_state(
        state: dict, groups: PriorGroups, jitter: float, locations: BatchFeatures
    ) -> Accumulators:
        """Inverse of :meth:`to_state`; also reads the states of formats 1 and 2.

        A format-2 state holds the whitened Jacobians ``G = L₀⁻¹ J_Z diag(w)``
        instead of the whitened group Grams ``C`` (``C^g = G^g diag(w^g)⁻¹ G^gᵀ``);
        a format-1 (0.1.0) state holds ``J_Z`` and
        ``B^{gh} = Σₙ K_Zn^g Λ̃ₙ K_nZ^h`` instead of ``G`` and ``W``, whitened
        once here (``W = L₀⁻¹ B L₀⁻ᵀ``, with the rounding of that form; fit
        again for batch-independent sums).

        Parameters
        ----------
        state : dict
            From :meth:`to_state`.
        groups : PriorGroups
            The posterior's prior groups (for a 0.1.0 state).
        jitter : float
            The posterior's relative jitter (for a 0.1.0 state's frame).
        locations : BatchFeatures
            The locations' features, computed again from the model.

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
            if "C" in state:
                weight, C = state["weight"], state["C"]
            else:  # format 2: whitened, weighted Jacobians
                weight = state["sqrt_w"].square()
                G_ = state["G"].reshape(-1, weight.numel()) / state["sqrt_w"]
                C = torch.stack([G_[:, a:b] @ G_[:, a:b].T for a, b in state["bounds"]])
            return Accumulators(
                locations=locations,
                weight=weight,
                bounds=tuple(tuple(b) for b in state["bounds"]),
                K_diag=state["K_diag"],
                L0=state["L0"],
                jitter=float(state["jitter"]),
                C=C,
                W=state["W"],
                u=state["u"],
                offset=state["offset"],
                **common,
            )
        J_z = state["J_z"].to(torch.float64)
        f_z = J_z.new_zeros(J_z.shape[:2])
        acc = Accumulators.empty(JacobianBatch(J_z, f_z), groups, jitter)
        acc.locations = locations
        W = torch.linalg.solve_triangular(acc.L0, state["B"], upper=False)
        acc.W = torch.linalg.solve_triangular(acc.L0, W.mT, upper=False).mT
        for key, value in common.items():
            setattr(acc, key, value)
        return acc


def _whiten_both(L0: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """``L₀⁻¹ K L₀⁻ᵀ``, symmetrised."""
    half = torch.linalg.solve_triangular(L0, K, upper=False)
    C = torch.linalg.solve_triangular(L0, half.mT, upper=False)
    return 0.5 * (C + C.mT)


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
