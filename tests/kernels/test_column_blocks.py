"""Jacobian Grams over millions of parameters: float32 sums stay accurate.

Each result is compared with a float64 ``einsum`` of the same Jacobians (the
reference), never with the blocked code itself.
"""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac.kernels._column_blocks import (
    COLUMN_BLOCK,
    jacobian_diagonal,
    jacobian_gram,
)


def _relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((got.double() - reference).abs() / reference.abs()).max())


@pytest.mark.parametrize("per_parameter", [False, True], ids=["scalar", "vector"])
def test_a_small_float32_gram_over_millions_of_parameters_is_accurate(per_parameter):
    """Positive entries: every product adds to the sum, the case where one long
    float32 dot product drifts most (1.5e-4 relative before the blocks)."""
    gen = torch.Generator().manual_seed(0)
    P = 1 << 22
    J1 = torch.rand(1, 2, P, generator=gen)
    J2 = torch.rand(1, 2, P, generator=gen)
    var = torch.rand(P, generator=gen) + 0.5 if per_parameter else torch.tensor(0.7)
    v64 = var.double()
    K_ref = torch.einsum("acp,p,bep->abce", J1.double(), v64.expand(P), J2.double())
    D_ref = torch.einsum("bcp,p,bep->bce", J1.double(), v64.expand(P), J1.double())
    assert _relative_error(jacobian_gram(J1, J2, var), K_ref) < 1e-5
    assert _relative_error(jacobian_diagonal(J1, var), D_ref) < 1e-5


@pytest.mark.parametrize("per_parameter", [False, True], ids=["scalar", "vector"])
def test_blocks_sum_to_the_whole_contraction_in_float64(per_parameter):
    """A column count that is no multiple of the block: the last block is short."""
    gen = torch.Generator().manual_seed(1)
    P = 3 * COLUMN_BLOCK + 5
    J1 = torch.randn(3, 2, P, generator=gen, dtype=torch.float64)
    J2 = torch.randn(4, 2, P, generator=gen, dtype=torch.float64)
    var = torch.rand(P, generator=gen, dtype=torch.float64) + 0.5
    var = var if per_parameter else var[0]
    full = var.expand(P)
    K_ref = torch.einsum("acp,p,bep->abce", J1, full, J2)
    D_ref = torch.einsum("bcp,p,bep->bce", J1, full, J1)
    torch.testing.assert_close(jacobian_gram(J1, J2, var), K_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(jacobian_diagonal(J1, var), D_ref, rtol=1e-12, atol=0)


def test_with_a_graph_the_gram_is_differentiable():
    """Under autograd the contraction is taken whole (no Jacobian-sized slice
    gradients) and its gradient is the reference's."""
    gen = torch.Generator().manual_seed(2)
    P = COLUMN_BLOCK + 7
    J1 = torch.randn(2, 2, P, generator=gen, dtype=torch.float64, requires_grad=True)
    J2 = torch.randn(2, 2, P, generator=gen, dtype=torch.float64)
    var = torch.tensor(0.3, dtype=torch.float64)
    weight = torch.randn(2, 2, 2, 2, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad((weight * jacobian_gram(J1, J2, var)).sum(), J1)
    # d/dJ1 of Σ w[a,b,c,e] var J1[a,c,:]·J2[b,e,:]
    expected = var * torch.einsum("abce,bep->acp", weight, J2)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
