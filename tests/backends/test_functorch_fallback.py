"""``DiffFuncGGN`` on Hugging Face models, where ``vmap`` cannot trace some of them.

``transformers`` builds the attention masks of BERT and of GPT-2's default
``sdpa`` attention with data-dependent control flow (``if mask.all():``), which
``torch.func.vmap`` cannot trace; the backend then runs the samples one by one.
Every model of the zoo (GPT-2 with ``sdpa`` and eager attention, BERT, ViT,
GPT-2 + peft's LoRA) is compared with the float64 per-sample autograd loop of
``tests.references`` on dict-like ``BatchEncoding`` batches (B = 3, C = 2):
Jacobians, GGN ``full``/``diag``, per-sample gradients, and gradients through the
Jacobians against central differences of the loop's values (PyTorch's own double
backward through ``layer_norm`` is wrong, so the loop's graph is no reference
there).
"""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, default_collate

import laplace_diffjac.backends._functorch_routes as routes
from laplace_diffjac import DiffBackPackGGN, DiffFuncGGN, UnsupportedModuleError
from tests import zoo_models
from tests.references import (
    assert_same_state,
    central_difference,
    loop_jacobians,
    model_state,
)

BATCH, CLASSES = 3, 2


def _lora() -> nn.Module:
    with warnings.catch_warnings():  # peft's note while it builds the model
        warnings.filterwarnings(
            "ignore", message="fan_in_fan_out is set to False", category=UserWarning
        )
        return zoo_models.gpt2_lora(CLASSES)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": lambda: zoo_models.gpt2(CLASSES),
    "gpt2-eager": lambda: zoo_models.gpt2(CLASSES, attention="eager"),
    "bert": lambda: zoo_models.bert(CLASSES),
    "vit": lambda: zoo_models.vit(CLASSES),
    "gpt2-lora": _lora,
}
UNTRACEABLE = ["gpt2", "bert", "gpt2-lora"]  # vmap fails in the attention masks
models = pytest.mark.parametrize("name", list(MODELS))


def _inputs(name: str, batch: int = BATCH, seed: int = 0):
    if name == "vit":
        return zoo_models.image_batch(batch, seed=seed)
    return zoo_models.text_batch(batch, seed=seed)


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def references() -> Callable[[str], tuple[torch.Tensor, torch.Tensor]]:
    """The loop's detached ``(J, f)`` by model name, each computed once here."""
    computed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def reference(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in computed:
            model = MODELS[name]()
            J, f = loop_jacobians(model, _inputs(name), _trainable(model))
            computed[name] = (J.detach(), f.detach())
        return computed[name]

    return reference


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to 1e-10 relative to the largest entry."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10 * scale)


@pytest.fixture
def route_log(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each call's probe decided: ``True`` for ``vmap``, ``False`` for a loop."""
    log: list[bool] = []
    probe = routes.vmap_traces

    def logged(*args):
        log.append(probe(*args))
        return log[-1]

    monkeypatch.setattr(routes, "vmap_traces", logged)
    return log


# -- why the fallback exists ---------------------------------------------------


@pytest.mark.parametrize("name", UNTRACEABLE)
def test_plain_vmap_jacrev_raises_on_the_model(name):
    """Without the fallback ``DiffFuncGGN`` would crash here: ``vmap(jacrev)``
    cannot trace the model (``.item()``/data-dependent control flow)."""
    model, x = MODELS[name](), _inputs(name)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}

    def single(p, xi):
        batch = {k: v[None] for k, v in xi.items()}
        return functional_call(model, p, (batch,), strict=False)[0]

    with (
        sdpa_kernel([SDPBackend.MATH]),
        pytest.raises(RuntimeError, match="vmap: It looks like you're"),
    ):
        vmap(jacrev(single), in_dims=(None, 0))(params, dict(x))


@models
def test_each_model_takes_the_expected_route(name, route_log):
    DiffFuncGGN(MODELS[name](), "classification").jacobians(_inputs(name))
    assert route_log == [name not in UNTRACEABLE]


# -- results against the per-sample autograd loop -------------------------------


@models
def test_jacobians_equal_the_loop(name, references):
    model, x = MODELS[name](), _inputs(name)
    backend = DiffFuncGGN(model, "classification")
    J, f = backend.jacobians(x)
    J_ref, f_ref = references(name)
    assert not J.requires_grad and not f.requires_grad
    _close(J, J_ref)
    _close(f, f_ref)
    chosen = torch.tensor([1, 0, 1])
    J_sel, _ = backend.selected_output_jacobians(x, chosen)
    _close(J_sel[:, 0], J_ref[torch.arange(BATCH), chosen])


@models
@pytest.mark.parametrize("structure", ["full", "diag"])
def test_ggn_equals_the_loop(name, structure, references):
    """``Σ_b J_bᵀ Λ_b J_b`` with ``Λ = diag(p) - ppᵀ``, and the summed loss."""
    model, x = MODELS[name](), _inputs(name)
    y = zoo_models.labels(BATCH, CLASSES)
    loss, H = getattr(DiffFuncGGN(model, "classification"), structure)(x, y)
    J, f = references(name)
    p = f.softmax(-1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    if structure == "full":
        H_ref = torch.einsum("bcp,bcd,bdq->pq", J, lam, J)
    else:
        H_ref = torch.einsum("bcp,bcd,bdp->p", J, lam, J)
    _close(H, H_ref)
    _close(loss, nn.functional.cross_entropy(f, y, reduction="sum"))


@models
def test_per_sample_gradients_equal_the_loop(name, references):
    model, x = MODELS[name](), _inputs(name)
    y = zoo_models.labels(BATCH, CLASSES)
    G, loss = DiffFuncGGN(model, "classification").gradients(x, y)
    J, f = references(name)
    residual = f.softmax(-1) - nn.functional.one_hot(y, CLASSES).to(f.dtype)
    _close(G, torch.einsum("bc,bcp->bp", residual, J))
    _close(loss, nn.functional.cross_entropy(f, y, reduction="sum"))


# -- enable_backprop=True: gradients through the Jacobians ----------------------


def _scalar(J: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """A fixed function of the Jacobians and outputs, with second derivatives."""
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(J.shape, dtype=J.dtype, generator=gen)
    return (weights * J * J).sum() + (f * f).sum()


def _direction(model: nn.Module) -> list[torch.Tensor]:
    """A random direction over the trainable parameters, zero on Embedding padding
    rows (PyTorch defines their gradient as zero although the output depends on
    them)."""
    gen = torch.Generator().manual_seed(2)
    chosen = {
        id(p): torch.randn(p.shape, dtype=p.dtype, generator=gen)
        for p in _trainable(model)
    }
    for m in model.modules():
        if isinstance(m, nn.Embedding) and m.padding_idx is not None:
            if id(m.weight) in chosen:
                chosen[id(m.weight)][m.padding_idx] = 0
    return [chosen[id(p)] for p in _trainable(model)]


def _shifted(model: nn.Module, direction: list[torch.Tensor], t: float) -> nn.Module:
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p, d in zip(_trainable(moved), direction):
            p.add_(t * d)
    return moved


@pytest.mark.slow
@models
def test_gradients_through_the_jacobians_equal_central_differences(name):
    model, x = MODELS[name](), _inputs(name)
    floating = isinstance(x, torch.Tensor)
    x_in = x.clone().requires_grad_(True) if floating else x
    J, f = DiffFuncGGN(model, "classification").jacobians(x_in, enable_backprop=True)
    assert J.requires_grad and f.requires_grad
    leaves = _trainable(model) + ([x_in] if floating else [])
    grads = torch.autograd.grad(_scalar(J, f), leaves)
    assert all(p.grad is None for p in model.parameters())

    direction = _direction(model)
    along = sum((g * d).sum() for g, d in zip(grads, direction))

    def loop_scalar(m: nn.Module, inputs) -> torch.Tensor:
        return _scalar(*loop_jacobians(m, inputs, _trainable(m)))

    # step 1e-6: the truncation error of 1e-5 is up to 8e-7 relative here
    expected = central_difference(
        lambda t: loop_scalar(_shifted(model, direction, t), x), step=1e-6
    )
    torch.testing.assert_close(along, expected, rtol=1e-7, atol=1e-9)
    if floating:  # the ViT's pixels
        u = torch.randn(
            x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(4)
        )
        expected = central_difference(
            lambda t: loop_scalar(model, x + t * u), step=1e-6
        )
        torch.testing.assert_close(
            (grads[-1] * u).sum(), expected, rtol=1e-7, atol=1e-9
        )


# -- nothing else changes on the loop's route ------------------------------------


METHODS: dict[str, Callable] = {
    "jacobians": lambda b, x, y: b.jacobians(x),
    "jacobians-backprop": lambda b, x, y: b.jacobians(x, enable_backprop=True),
    "selected": lambda b, x, y: b.selected_output_jacobians(x, y),
    "full": lambda b, x, y: b.full(x, y),
    "diag": lambda b, x, y: b.diag(x, y),
    "gradients": lambda b, x, y: b.gradients(x, y),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_fallback_leaves_the_model_as_it_was(method, route_log):
    """Parameters, buffers, ``.grad``, hooks (which still fire), attributes and
    training mode; no warning; ``torch.func`` left at no transform level."""
    model, x = MODELS["bert"](), _inputs("bert")
    y = zoo_models.labels(BATCH, CLASSES)
    for p in model.parameters():  # gradients a user had accumulated
        p.grad = torch.randn_like(p)
    calls = []
    handle = model.hf_model.bert.embeddings.register_forward_hook(
        lambda *args: calls.append(1)
    )
    before = model_state(model)
    backend = DiffFuncGGN(model, "classification")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        METHODS[method](backend, x, y)
    assert [str(w.message) for w in caught] == []
    assert route_log == [False] and calls
    assert_same_state(before, model_state(model))
    calls.clear()
    model(x)
    assert calls == [1]
    handle.remove()
    ones = torch.ones(2, 3, dtype=torch.float64)  # no vmap level left behind
    cos = vmap(jacrev(lambda t: t.sin().sum()))(ones)
    assert type(cos) is torch.Tensor and torch.equal(cos, ones.cos())


class _DataDependent(nn.Module):
    """A float-input model ``vmap`` cannot trace: a branch on the data."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(3, 4)
        self.out = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(x))
        if bool((h.abs() > 10).any()):  # never true; vmap cannot tell
            h = h.clamp(-10, 10)
        return self.out(h)


def test_fallback_frees_its_inputs_without_the_garbage_collector(route_log):
    """No reference cycle: the failed probe's traceback and graph are gone."""
    backend = DiffFuncGGN(_DataDependent().double(), "classification")
    gc.disable()
    try:
        x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        ref = weakref.ref(x)
        J, f = backend.jacobians(x, enable_backprop=True)
        (J.square().sum() + f.sum()).backward()
        del x, J, f
        assert ref() is None
    finally:
        gc.enable()
    assert route_log == [False]


def test_a_genuine_error_of_the_model_still_surfaces():
    """The probe's failure only chooses the loop, which raises the model's error."""
    model = MODELS["bert"]()
    x = _inputs("bert")
    x["input_ids"] = x["input_ids"] + zoo_models.VOCAB  # out of the vocabulary
    with pytest.raises(IndexError, match="index out of range"):
        DiffFuncGGN(model, "classification").jacobians(x)


# -- laplace-torch on a DataLoader of BatchEncodings -----------------------------


def _loader(n: int = 6) -> DataLoader:
    from transformers import BatchEncoding

    encoded = zoo_models.text_batch(n, seed=1)
    y = zoo_models.labels(n, CLASSES, seed=1)
    rows = [{**{k: v[i] for k, v in encoded.items()}, "labels": y[i]} for i in range(n)]
    return DataLoader(
        rows, batch_size=BATCH, collate_fn=lambda r: BatchEncoding(default_collate(r))
    )


def _loop_ggn(model: nn.Module, loader: DataLoader) -> torch.Tensor:
    H = 0
    for batch in loader:
        J, f = loop_jacobians(model, batch, _trainable(model))
        J, p = J.detach(), f.detach().softmax(-1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        H = H + torch.einsum("bcp,bcd,bdq->pq", J, lam, J)
    return H


@pytest.mark.slow
@pytest.mark.parametrize("structure", ["full", "diag"])
@pytest.mark.parametrize("name", ["bert", "gpt2-lora"])
def test_laplace_fit_and_predictive_on_batch_encodings(name, structure, route_log):
    model, loader = MODELS[name](), _loader()
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure=structure,
        backend=DiffFuncGGN,
    )
    la.fit(loader)
    assert route_log and not any(route_log)
    H_ref = _loop_ggn(model, loader)
    if structure == "diag":
        H_ref = H_ref.diagonal()
    _close(la.H, H_ref)

    x = zoo_models.text_batch(2, seed=7)
    probs = la(x, pred_type="glm", link_approx="probit")
    J, f = loop_jacobians(model, x, _trainable(model))
    J, f = J.detach(), f.detach()
    if structure == "full":
        cov = torch.linalg.inv(H_ref + torch.eye(len(H_ref), dtype=H_ref.dtype))
        f_var = torch.einsum("bcp,pq,bdq->bcd", J, cov, J)
    else:
        f_var = torch.einsum("bcp,p,bdp->bcd", J, 1 / (H_ref + 1), J)
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * f_var.diagonal(dim1=1, dim2=2))
    torch.testing.assert_close(probs, (kappa * f).softmax(-1), rtol=1e-9, atol=1e-12)


# -- kron: refused with routes that work -----------------------------------------


@pytest.mark.parametrize("name", ["bert", "vit", "gpt2"])
def test_kron_refusal_names_diag_full_here_and_diffbackpackggn(name):
    model, x = MODELS[name](), _inputs(name)
    y = zoo_models.labels(BATCH, CLASSES)
    before = model_state(model)
    with pytest.raises(UnsupportedModuleError, match="LayerNorm") as info:
        DiffFuncGGN(model, "classification").kron(x, y, 10)
    message = str(info.value)
    assert "hessian_structure='diag' or 'full' with this backend" in message
    assert "DiffBackPackGGN for hessian_structure='kron'" in message
    assert_same_state(before, model_state(model))
    DiffFuncGGN(model, "classification").diag(x, y)  # the route it names works


@pytest.mark.parametrize("name", ["bert", "vit"])
def test_diffbackpackggn_kron_takes_what_difffuncggn_kron_refuses(name):
    model, x = MODELS[name](), _inputs(name)
    y = zoo_models.labels(BATCH, CLASSES)
    DiffBackPackGGN(model, "classification").kron(x, y, 10)
