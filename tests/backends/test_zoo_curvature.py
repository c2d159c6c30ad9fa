"""The models people download, every curvature of the BackPACK backends, in float64.

GPT-2 (sdpa and eager attention), BERT, ViT and GPT-2 with peft's LoRA on padded
``BatchEncoding`` batches (BERT also as a regression), and torchvision's ResNet and
MobileNetV3-small, from ``tests/zoo_models.py``, against the references of
``tests/curvature_references.py`` (plain autograd, one sample at a time):

* ``DiffBackPackGGN.full`` = ``sum_b J_b^T Lambda_b J_b`` from ``loop_jacobians``;
* ``jacobians(enable_backprop=True)``: ``J`` and ``f`` equal the loop's, and so do
  the gradients of a random contraction of them (parameters for token models,
  pixels for image models);
* ``DiffBackPackGGN.diag`` = the exact GGN diagonal;
* ``DiffBackPackGGN.kron``: per parameter, the product ``F0 kron F1`` equals KFAC
  (expand, the default, or reduce, chosen in the constructor or the call) for
  Linear, Conv1D and Embedding weights, BackPACK's KFLR for convolutions, the exact
  block for normalisation parameters and ViT's class and position embeddings, the
  nearest Kronecker product of the exact block for depthwise convolutions;
* ``DiffBackPackEF.diag`` = ``factor * sum_b g_b**2`` of per-sample loss gradients,
  ``DiffBackPackEF.full`` = ``factor * sum_b g_b g_b^T``;
* ``DiffFuncGGN.diag`` = the exact GGN diagonal where ``vmap`` runs the model
  (eager GPT-2, ViT, ResNet, MobileNetV3; not sdpa GPT-2, BERT or LoRA, whose
  forwards branch on data).

Every call must leave the model as it was. The torchvision cases are slow (a
4.9-million-parameter ResNet: references per parameter, never ``P x P``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from laplace_diffjac import DiffBackPackEF, DiffBackPackGGN, DiffFuncGGN
from tests import curvature_references as ref
from tests import zoo_models as zoo
from tests.references import (
    assert_same_state,
    loop_jacobians,
    model_state,
    reference_forward,
)

RTOL = 1e-10

CASES = {case.name: case for case in [*zoo.HF_CASES, *zoo.TORCHVISION_CASES]}
_slow = [
    pytest.param(c, marks=pytest.mark.slow, id=c.name) for c in zoo.TORCHVISION_CASES
]
hf_cases = pytest.mark.parametrize("case", zoo.HF_CASES, ids=lambda c: c.name)
all_cases = pytest.mark.parametrize(
    "case", [*[pytest.param(c, id=c.name) for c in zoo.HF_CASES], *_slow]
)

#: How ``kfac_approx`` reaches ``kron``: (constructor kwargs, call kwargs, approx).
KRON_VARIANTS: dict[str, tuple[dict, dict, ref.KFACApprox]] = {
    "default": ({}, {}, "expand"),
    "expand-constructor": ({"kfac_approx": "expand"}, {}, "expand"),
    "reduce-constructor": ({"kfac_approx": "reduce"}, {}, "reduce"),
    "reduce-call": ({}, {"kfac_approx": "reduce"}, "reduce"),
}
#: Where DiffFuncGGN's vmap runs the model.
FUNC_CASES = [
    *[pytest.param(CASES[n], id=n) for n in ("gpt2-eager", "vit")],
    *[
        pytest.param(CASES[n], id=n, marks=pytest.mark.slow)
        for n in ("resnet", "mobilenet")
    ],
]
KRON_CASES = [
    *[
        pytest.param(case, variant, id=f"{case.name}-{variant}")
        for case in zoo.HF_CASES
        for variant in KRON_VARIANTS
    ],
    *[
        pytest.param(c, "default", marks=pytest.mark.slow, id=f"{c.name}-default")
        for c in zoo.TORCHVISION_CASES
    ],
]


class _References:
    """The references of each case, computed once per module on a fresh model."""

    def __init__(self) -> None:
        self._cache: dict[tuple, Any] = {}

    def get(self, name: str, what: str, approx: ref.KFACApprox = "expand") -> Any:
        key = (name, what, approx)
        if key not in self._cache:
            self._cache[key] = self._compute(CASES[name], what, approx)
        return self._cache[key]

    @staticmethod
    def _compute(case: zoo.ZooCase, what: str, approx: ref.KFACApprox) -> Any:
        model, batch = case.model(), case.batch()
        compute: dict[str, Callable[[], Any]] = {
            "loss": lambda: _reference_loss(model, batch, case.likelihood),
            "full": lambda: ref.ggn_full(model, [batch], case.likelihood),
            "diag": lambda: ref.exact_ggn(model, [batch], case.likelihood).diagonal,
            "kron": lambda: ref.kron_reference(
                model, [batch], case.likelihood, kfac_approx=approx
            ),
            "ef_diag": lambda: ref.ef_diagonal(model, [batch], case.likelihood),
            "ef_full": lambda: ref.ef_full(model, [batch], case.likelihood),
        }
        return compute[what]()


@pytest.fixture(scope="module")
def references() -> _References:
    return _References()


def _reference_loss(model, batch, likelihood) -> torch.Tensor:
    x, y = batch
    with reference_forward(model), torch.no_grad():
        return ref.scaled_loss(model(x), y, likelihood)


def _close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, scale: float | None = None
) -> None:
    """Entries equal to ``RTOL``, relative to the largest expected entry (or scale)."""
    atol = RTOL * (expected.abs().max().item() if scale is None else scale)
    torch.testing.assert_close(
        actual.detach(), expected, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}"
    )


def _names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


@hf_cases
def test_full_equals_loop_reference(case, references):
    model, (x, y) = case.model(), case.batch()
    before = model_state(model)
    loss, H = DiffBackPackGGN(model, case.likelihood).full(x, y)
    assert_same_state(before, model_state(model))
    _close(H, references.get(case.name, "full"), "full GGN")
    _close(loss, references.get(case.name, "loss"), "loss")


@all_cases
def test_jacobians_with_backprop_equal_loop_reference(case):
    """``J`` and ``f`` equal the loop's, and so does a gradient through them."""
    model, (x, _) = case.model(), case.batch()
    params = ref.trainable(model)
    images = isinstance(x, torch.Tensor)
    if images:
        x = x.clone().requires_grad_(True)
    # Image models: the gradient in the pixels (and ViT's parameters); token
    # models: in the parameters. ResNet's 4.9 M parameters are left out.
    wrt = ([x] if images else []) + (params if case.name != "resnet" else [])
    Js, f = DiffBackPackGGN(model, case.likelihood).jacobians(x, enable_backprop=True)
    J_ref, f_ref = loop_jacobians(model, x, params)
    _close(Js, J_ref.detach(), "Jacobians")
    _close(f, f_ref.detach(), "outputs")
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(Js.shape[-1], generator=gen, dtype=Js.dtype)
    u = torch.randn(Js.shape[:2], generator=gen, dtype=Js.dtype)
    v = torch.randn(f.shape, generator=gen, dtype=f.dtype)
    grads = torch.autograd.grad(
        torch.einsum("bcp,p,bc->", Js, w, u) + (f * v).sum(), wrt
    )
    expected = torch.autograd.grad(
        torch.einsum("bcp,p,bc->", J_ref, w, u) + (f_ref * v).sum(), wrt
    )
    # Relative to the largest entry of all: the gradient of an attention key's bias
    # vanishes in exact arithmetic and holds round-off only.
    scale = max(e.abs().max().item() for e in expected)
    for i, (g, e) in enumerate(zip(grads, expected)):
        _close(g, e, f"gradient {i} through the Jacobians", scale)


@all_cases
def test_diag_equals_exact_ggn_diagonal(case, references):
    model, (x, y) = case.model(), case.batch()
    before = model_state(model)
    loss, diag = DiffBackPackGGN(model, case.likelihood).diag(x, y)
    assert_same_state(before, model_state(model))
    _close(diag, references.get(case.name, "diag"), "GGN diagonal")
    _close(loss, references.get(case.name, "loss"), "loss")


@pytest.mark.parametrize(("case", "variant"), KRON_CASES)
def test_kron_products_equal_reference(case, variant, references):
    """One batch, ``N = M``: laplace-torch's rescaling ``F[1] *= M / N`` is 1."""
    init_kwargs, call_kwargs, approx = KRON_VARIANTS[variant]
    model, (x, y) = case.model(), case.batch()
    before = model_state(model)
    backend = DiffBackPackGGN(model, case.likelihood, **init_kwargs)
    loss, kron = backend.kron(x, y, N=len(y), **call_kwargs)
    assert_same_state(before, model_state(model))
    expected = references.get(case.name, "kron", approx)
    ref.assert_kron_close(kron.kfacs, expected, RTOL, names=_names(model))
    _close(loss, references.get(case.name, "loss"), "loss")


@all_cases
def test_ef_diag_equals_per_sample_gradients(case, references):
    model, (x, y) = case.model(), case.batch()
    before = model_state(model)
    loss, diag = DiffBackPackEF(model, case.likelihood).diag(x, y)
    assert_same_state(before, model_state(model))
    _close(diag, references.get(case.name, "ef_diag"), "EF diagonal")
    _close(loss, references.get(case.name, "loss"), "loss")


@hf_cases
def test_ef_full_equals_per_sample_gradients(case, references):
    model, (x, y) = case.model(), case.batch()
    loss, H = DiffBackPackEF(model, case.likelihood).full(x, y)
    _close(H, references.get(case.name, "ef_full"), "EF")
    _close(loss, references.get(case.name, "loss"), "loss")


@pytest.mark.parametrize("case", FUNC_CASES)
def test_diff_func_ggn_diag_equals_exact_ggn_diagonal(case, references):
    model, (x, y) = case.model(), case.batch()
    loss, diag = DiffFuncGGN(model, case.likelihood).diag(x, y)
    _close(diag, references.get(case.name, "diag"), "GGN diagonal")
    _close(loss, references.get(case.name, "loss"), "loss")
