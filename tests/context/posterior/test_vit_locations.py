"""A context posterior with optimised locations on a Hugging Face ViT's pixels.

The locations are images: :func:`~laplace_diffjac.optimize_locations` moves them
through the NTK of a ViT (``transformers``, small config, float64), whose class
token and position embeddings the engine's local rule differentiates, and the
context posterior on them equals the dense DTC formulas written with the per-
sample autograd loop's Jacobians.
"""

from __future__ import annotations

import torch

from laplace_diffjac import ContextPosterior, LocationSettings, optimize_locations
from tests import zoo_models as zoo
from tests.references import loop_jacobians

TOL = {"rtol": 1e-8, "atol": 1e-10}


def _dense_covariance(model, x, z, xs, prec: float) -> torch.Tensor:
    Jx, fx = loop_jacobians(model, x)
    Jz, _ = loop_jacobians(model, z)
    Js, _ = loop_jacobians(model, xs)
    Jx, Jz, Js = (J.detach().flatten(0, 1) / prec**0.5 for J in (Jx, Jz, Js))
    p = fx.detach().softmax(-1)
    lam = torch.block_diag(*(torch.diag_embed(p) - p[:, :, None] * p[:, None, :]))
    Kzz, Kzx, Kzs, Kss = Jz @ Jz.T, Jz @ Jx.T, Jz @ Js.T, Js @ Js.T
    inner = Kzz + Kzx @ lam @ Kzx.T
    return Kss - Kzs.T @ (torch.linalg.inv(Kzz) - torch.linalg.inv(inner)) @ Kzs


def test_optimised_pixel_locations_and_their_posterior_equal_the_dense_formulas(
    assembled_widths,
):
    model = zoo.vit()
    x, y = zoo.image_batch(10, seed=1), zoo.labels(10, seed=1)
    xs = zoo.image_batch(3, seed=2)
    init = zoo.image_batch(2, seed=3)
    settings = LocationSettings(steps=15, lr=0.05, patience=100, progress_bar=False)
    result = optimize_locations(
        model, "classification", (x, y), m=2, init=init, settings=settings,
        prior_precision=2.0, jitter=0.0,
    )  # fmt: skip
    z = result.locations
    assert z.shape == init.shape and not torch.equal(z, init)
    assert result.history.objective[-1] < result.history.objective[0]
    cp = ContextPosterior(
        model, "classification", z, prior_precision=2.0, jitter=0.0, batch_size=4
    ).fit((x, y))
    _, joint = cp.joint_predictive(xs)
    # the factor route: no Jacobian wider than one parameter's block was written
    assert max(assembled_widths, default=1) == 1
    torch.testing.assert_close(joint, _dense_covariance(model, x, z, xs, 2.0), **TOL)
