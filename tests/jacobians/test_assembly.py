"""The fused Jacobian assembly against blocks built with plain einsum and cat."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from laplace_diffjac.jacobians._assembly import (
    Dense,
    Product,
    Scattered,
    Summed,
    assemble,
)

V, B, S = 3, 2, 4  # rows, samples, embedding rows


def _factors(positions: int, seed: int = 0) -> dict:
    """Factors of five parameters: a shared weight (two calls), a bias, a dense
    block, one parameter without factors, and an embedding table (two calls, rows
    looked up repeatedly)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return t.requires_grad_(True)

    out, k = 4, 5
    weight = torch.empty(out, k)
    bias = torch.empty(out)
    other = torch.empty(2, 3)
    unused = torch.empty(7)
    table = torch.empty(S, 3)
    # a strided (transposed) input factor, as the Conv2d rule passes patches
    a1 = rand(B, k, positions).transpose(1, 2)
    tensors = {
        "g1": rand(B, V, out, positions),
        "a1": a1,
        "g2": rand(B, V, out, positions),
        "a2": rand(B, positions, k),
        "gb": rand(V, B, out, positions),
        "dense": rand(V, B, 6),
        "ge1": rand(V, B, positions + 2, 3),
        "ge2": rand(V, B, 2, 3),
    }
    return {
        "params": [weight, bias, unused, other, table],
        "index1": torch.randint(0, S, (B, positions + 2), generator=gen),
        "index2": torch.tensor([[1, 1], [0, S - 1]]),
        "tensors": tensors,
    }


def _build(case: dict, t: dict) -> dict:
    weight, bias, _, other, table = case["params"]
    return {
        id(weight): [Product(t["g1"], t["a1"]), Product(t["g2"], t["a2"])],
        id(bias): [Summed(t["gb"])],
        id(other): [Dense(t["dense"])],
        id(table): [
            Scattered(t["ge1"], case["index1"]),
            Scattered(t["ge2"], case["index2"]),
        ],
    }


def _reference(case: dict, t: dict) -> torch.Tensor:
    w = torch.einsum("bvol,blk->bvok", t["g1"], t["a1"])
    w = w + torch.einsum("bvol,blk->bvok", t["g2"], t["a2"])
    b = t["gb"].sum(3).transpose(0, 1)
    e = sum(  # one-hot products, the dense form of the scatter
        torch.einsum("bls,vblk->bvsk", nn.functional.one_hot(i, S).double(), g)
        for i, g in ((case["index1"], t["ge1"]), (case["index2"], t["ge2"]))
    )
    return torch.cat(
        [
            w.flatten(2),
            b,
            torch.zeros(B, V, 7, dtype=torch.float64),
            t["dense"].transpose(0, 1),
            e.flatten(2),
        ],
        dim=2,
    )


@pytest.mark.parametrize("positions", [1, 4], ids=["outer", "contraction"])
def test_assembly_equals_einsum_and_cat(positions):
    case = _factors(positions)
    t = case["tensors"]
    J = assemble(_build(case, t), case["params"], V, B, t["g1"])
    ref = _reference(case, t)
    torch.testing.assert_close(J, ref, rtol=1e-12, atol=1e-12)

    weights = torch.randn_like(ref)
    grads = torch.autograd.grad((J * weights).sum(), list(t.values()))
    grads_ref = torch.autograd.grad((ref * weights).sum(), list(t.values()))
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("positions", [1, 3], ids=["outer", "contraction"])
def test_assembly_gradcheck_and_gradgradcheck(positions):
    case = _factors(positions, seed=1)
    names = list(case["tensors"])
    params = case["params"]

    def fn(*tensors):
        t = dict(zip(names, tensors))
        return assemble(_build(case, t), params, V, B, tensors[0])

    inputs = tuple(case["tensors"].values())
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_assembly_without_rows_or_factors_is_zero():
    case = _factors(1)
    t = case["tensors"]
    params = case["params"]
    empty = assemble({}, params, V, B, t["g1"])
    n_params = 4 * 5 + 4 + 7 + 6 + S * 3
    assert empty.shape == (B, V, n_params) and not empty.any()
    no_rows = {id(params[1]): [Summed(t["gb"][:0])]}
    assert assemble(no_rows, params, 0, B, t["g1"]).shape == (B, 0, n_params)
