"""What ``ContextPosterior.fit`` keeps of the data: sums, never the data.

With the Jacobians ``J_Z`` ``(M, C, P)`` at the locations, parameter groups
``g`` (:class:`._hyperparameters.PriorGroups`) with fixed weights ``w`` and the
unscaled likelihood Hessians ``Λ̃ₙ`` (without ``1 / (σ² T)``), the accumulators are,
summed over the training points::

    K_ZZ^g   = J_Z^g diag(w^g) J_Z^gᵀ                        (G, MC, MC)
    B^{gh}   = Σₙ K_Zn^g Λ̃ₙ K_nZ^h,  K_Zn^g = J_Z^g diag(w^g) Jₙ^gᵀ  (G, G, MC, MC)
    d        = Σₙ diag(Jₙᵀ Λ̃ₙ Jₙ)                            (P,)
    loss     = Σₙ ½‖yₙ − f(xₙ)‖² (regression) or Σₙ −log softmax(f(xₙ))_{yₙ}

For group prior variances ``s_g`` the posterior needs ``K_ZZ = Σ_g s_g K_ZZ^g`` and
``K_ZX Λ̃ K_XZ = Σ_{g,h} s_g s_h B^{gh}``, both exact for every ``s``; the trace
term of the evidence needs ``Σₙ tr(Λ̃ₙ kₙₙ) = Σ_p Σ₀_p d_p``, exact for every
per-parameter ``Σ₀``. All sums are additive over data, so ``update`` adds a batch
without touching the old data. The ``σ²`` and ``T`` factors are applied later, so
changing them after ``fit`` is exact as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...data import is_distributed, reduce_sum
from ...kernels import output_hessians
from ...kernels._ntk import flat_gram
from ._hyperparameters import PriorGroups

__all__ = ["Accumulators", "reduce_accumulators"]


@dataclass
class Accumulators:
    """Sums over the training data, in float64; see the module docstring.

    Attributes
    ----------
    J_z : torch.Tensor
        ``(M, C, P)``.
    K_zz : torch.Tensor
        ``(G, MC, MC)``.
    B : torch.Tensor
        ``(G, G, MC, MC)``.
    ggn_diag : torch.Tensor
        ``(P,)``.
    loss : torch.Tensor
        ``()``; meaningful only if ``has_targets``.
    n_data : int
        Number of points accumulated.
    has_targets : bool
        Whether every batch had targets (the evidence needs them).

    """

    J_z: torch.Tensor
    K_zz: torch.Tensor
    B: torch.Tensor
    ggn_diag: torch.Tensor
    loss: torch.Tensor = field(
        default_factory=lambda: torch.zeros((), dtype=torch.float64)
    )
    n_data: int = 0
    has_targets: bool = True

    @staticmethod
    def empty(J_z: torch.Tensor, groups: PriorGroups) -> Accumulators:
        """Zero sums for locations with Jacobians ``J_z`` (float64)."""
        M, C, P = J_z.shape
        G, w = len(groups.bounds), groups.weight.to(J_z)
        K_zz = torch.stack(
            [flat_gram(J_z[..., a:b], J_z[..., a:b], w[a:b]) for a, b in groups.bounds]
        )
        zeros = J_z.new_zeros
        return Accumulators(
            J_z=J_z,
            K_zz=0.5 * (K_zz + K_zz.mT),
            B=zeros(G, G, M * C, M * C),
            ggn_diag=zeros(P),
            loss=zeros(()),
        )

    def zeros_like(self) -> Accumulators:
        """Zero data sums for the same locations (``J_z``, ``K_zz`` shared)."""
        return Accumulators(
            J_z=self.J_z,
            K_zz=self.K_zz,
            B=torch.zeros_like(self.B),
            ggn_diag=torch.zeros_like(self.ggn_diag),
            loss=torch.zeros_like(self.loss),
        )

    def merge(self, other: Accumulators) -> None:
        """Add the data sums of ``other`` (same locations and groups), in place."""
        self.B = self.B + other.B
        self.ggn_diag = self.ggn_diag + other.ggn_diag
        self.loss = self.loss + other.loss.to(self.loss)
        self.n_data += other.n_data
        self.has_targets = self.has_targets and other.has_targets

    def add(
        self,
        Js: torch.Tensor,
        f: torch.Tensor,
        y: torch.Tensor | None,
        groups: PriorGroups,
        likelihood: str,
    ) -> None:
        """Add one batch: Jacobians ``(b, C, P)``, outputs ``(b, C)``, targets."""
        Js, f = Js.to(torch.float64), f.to(torch.float64)
        lam = output_hessians(f, likelihood)  # (b, C, C), without 1 / (σ² T)
        MC, w = self.B.shape[-1], groups.weight.to(Js)
        Ks, Vs = [], []
        for a, b in groups.bounds:
            K = flat_gram(self.J_z[..., a:b], Js[..., a:b], w[a:b]).reshape(
                MC, *f.shape
            )
            Ks.append(K.reshape(MC, -1))
            Vs.append(torch.einsum("kbc,bce->kbe", K, lam).reshape(MC, -1))
        for g, K in enumerate(Ks):
            for h, V in enumerate(Vs):
                self.B[g, h] += K @ V.T
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

    def symmetrised_B(self) -> torch.Tensor:
        """``B`` with each ``(g, h)`` block pair made exactly symmetric."""
        return 0.5 * (self.B + self.B.permute(1, 0, 3, 2))

    def to_state(self) -> dict[str, torch.Tensor | int | bool]:
        """Tensors and plain values only, for ``torch.load(weights_only=True)``."""
        return {
            "J_z": self.J_z,
            "K_zz": self.K_zz,
            "B": self.B,
            "ggn_diag": self.ggn_diag,
            "loss": self.loss,
            "n_data": self.n_data,
            "has_targets": self.has_targets,
        }

    @staticmethod
    def from_state(state: dict) -> Accumulators:
        """Inverse of :meth:`to_state`."""
        return Accumulators(
            J_z=state["J_z"],
            K_zz=state["K_zz"],
            B=state["B"],
            ggn_diag=state["ggn_diag"],
            loss=state["loss"],
            n_data=int(state["n_data"]),
            has_targets=bool(state["has_targets"]),
        )


def reduce_accumulators(acc: Accumulators) -> None:
    """Sum ``acc``'s data sums over the ranks, in place (one ``all_reduce``).

    ``B``, the GGN diagonal, the loss, ``N`` and the count of ranks without
    targets are packed into one float64 buffer; the counts stay exact below
    ``2⁵³``. ``J_z`` and ``K_zz`` do not depend on the data and are not reduced.

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
            acc.B.reshape(-1),
            acc.ggn_diag,
            acc.loss.reshape(1).to(acc.B),
            torch.tensor(counts, dtype=acc.B.dtype, device=acc.B.device),
        ]
    )
    flat = reduce_sum(flat)
    n_b, n_d = acc.B.numel(), acc.ggn_diag.numel()
    acc.B = flat[:n_b].reshape(acc.B.shape).clone()
    acc.ggn_diag = flat[n_b : n_b + n_d].clone()
    acc.loss = flat[n_b + n_d].clone()
    acc.n_data = int(round(float(flat[-2])))
    acc.has_targets = float(flat[-1]) == 0.0
