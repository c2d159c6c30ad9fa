"""The fused Jacobian assembly against blocks built with plain einsum and cat."""

from __future__ import annotations

import pytest
import torch

from laplace_diffjac.jacobians._assembly import Dense, Product, Summed, assemble

V, B = 3, 2


def _factors(positions: int, seed: int = 0) -> dict:
    """Factors of four parameters: a shared weight (two calls), a bias, a dense
    block, and one parameter without factors."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return t.requires_grad_(True)

    out, k = 4, 5
    weight = torch.empty(out, k)
    bias = torch.empty(out)
    other = torch.empty(2, 3)
    unused = torch.empty(7)
    # a strided (transposed) input factor, as the Conv2d rule passes patches
    a1 = rand(B, k, positions).transpose(1, 2)
    tensors = {
        "g1": rand(B, V, out, positions),
        "a1": a1,
        "g2": rand(B, V, out, positions),
        "a2": rand(B, positions, k),
        "gb": rand(V, B, out, positions),
        "dense": rand(V, B, 6),
    }
    return {
        "params": [weight, bias, unused, other],
        "tensors": tensors,
    }


def _build(params: list, t: dict) -> dict:
    weight, bias, _, other = params
    return {
        id(weight): [Product(t["g1"], t["a1"]), Product(t["g2"], t["a2"])],
        id(bias): [Summed(t["gb"])],
        id(other): [Dense(t["dense"])],
    }


def _reference(t: dict) -> torch.Tensor:
    w = torch.einsum("bvol,blk->bvok", t["g1"], t["a1"])
    w = w + torch.einsum("bvol,blk->bvok", t["g2"], t["a2"])
    b = t["gb"].sum(3).transpose(0, 1)
    return torch.cat(
        [
            w.flatten(2),
            b,
            torch.zeros(B, V, 7, dtype=torch.float64),
            t["dense"].transpose(0, 1),
        ],
        dim=2,
    )


@pytest.mark.parametrize("positions", [1, 4], ids=["outer", "contraction"])
def test_assembly_equals_einsum_and_cat(positions):
    case = _factors(positions)
    t = case["tensors"]
    J = assemble(_build(case["params"], t), case["params"], V, B, t["g1"])
    ref = _reference(t)
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
        return assemble(_build(params, t), params, V, B, tensors[0])

    inputs = tuple(case["tensors"].values())
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_assembly_without_rows_or_factors_is_zero():
    case = _factors(1)
    t = case["tensors"]
    params = case["params"]
    empty = assemble({}, params, V, B, t["g1"])
    assert empty.shape == (B, V, 4 * 5 + 4 + 7 + 6) and not empty.any()
    no_rows = {id(params[1]): [Summed(t["gb"][:0])]}
    assert assemble(no_rows, params, 0, B, t["g1"]).shape == (B, 0, 37)
