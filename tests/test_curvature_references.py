"""The curvature references themselves, against curvlinops, BackPACK and each other.

``tests/curvature_references.py`` is what the zoo's curvature tests compare with;
here it is checked against implementations that share nothing with it: curvlinops'
``KFACLinearOperator`` (KFAC-expand and -reduce on ``nn.Linear`` layers fed tokens),
laplace-torch's ``BackPackGGN``/``BackPackEF`` (BackPACK's ``KFLR``,
``DiagGGNExact``, ``SumGradSquared``, ``BatchGrad`` on ``nn.Sequential`` models),
``DiffFuncGGN.full`` (``vmap(jacrev)``), and, for the nearest Kronecker product, a
block that is exactly a Kronecker product and a dense SVD.
"""

from __future__ import annotations

import copy

import pytest
import torch
from curvlinops import KFACLinearOperator
from curvlinops.kfac import FisherType
from laplace.curvature import BackPackEF, BackPackGGN
from torch import nn
from torch.nn import functional as F

from laplace_diffjac import DiffFuncGGN
from tests import curvature_references as ref
from tests import zoo_models as zoo
from tests.conftest import CASES
from tests.laplace_integration.helpers import upstream_quiet
from tests.references import reference_forward

RTOL = 1e-10
LIKELIHOODS = ["classification", "regression"]
ZOO = {case.name: case for case in zoo.HF_CASES}


def _conv1d_net(c: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(2, 3, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv1d(3, 2, 2, dilation=2),
        nn.Flatten(),
        nn.Linear(4, c),
    )


def _conv3d_net(c: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(1, 2, 2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(128, c)
    )


#: nn.Sequential models BackPACK extends: (name, model, input shape).
SEQUENTIAL = [
    *[(c.name, c.make_model, c.input_shape) for c in CASES if c.name == "mlp-C3"],
    *[(c.name, c.make_model, c.input_shape) for c in CASES if c.name == "cnn-C3"],
    ("conv1d", _conv1d_net, (2, 7)),
    ("conv3d", _conv3d_net, (1, 3, 3, 3)),
]
sequential = pytest.mark.parametrize(
    ("make_model", "input_shape"),
    [s[1:] for s in SEQUENTIAL],
    ids=[s[0] for s in SEQUENTIAL],
)
likelihoods = pytest.mark.parametrize("likelihood", LIKELIHOODS)


def _sequential_case(make_model, input_shape, likelihood, batch=5):
    torch.manual_seed(0)
    model = make_model(3).double().eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *input_shape, generator=gen, dtype=torch.float64)
    return model, x, zoo.targets(likelihood, batch, 3)


@pytest.fixture(autouse=True)
def _float64_default():
    """BackPACK's AvgPool2d derivative builds its helper conv in the default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# --- KFAC against curvlinops (tokens) and BackPACK (nn.Sequential)


def _linear_params(model: nn.Module) -> list[torch.Tensor]:
    return [
        p
        for module in model.modules()
        if isinstance(module, nn.Linear)
        for p in module.parameters(recurse=False)
        if p.requires_grad
    ]


def _curvlinops_state(model, loss, params, x, y, approx) -> dict:
    """curvlinops' ``KFACLinearOperator`` (TYPE2, separate bias) ``state_dict``."""
    extra = {}
    if not isinstance(x, torch.Tensor):
        extra["batch_size_fn"] = ref.batch_size
    linop = KFACLinearOperator(
        model,
        loss,
        params,
        [(x, y)],
        check_deterministic=False,
        fisher_type=FisherType.TYPE2,
        separate_weight_and_bias=True,
        kfac_approx=approx,
        **extra,
    )
    linop.compute_kronecker_factors()
    return linop.state_dict()


def _curvlinops_kron(model, loss, params, x, y, approx) -> list[list[torch.Tensor]]:
    """curvlinops' KFAC factors in laplace-torch 0.3's ``CurvlinopsGGN`` layout."""
    state = _curvlinops_state(model, loss, params, x, y, approx)
    blocks: dict[int, list[torch.Tensor]] = {}
    for name, roles in KFACLinearOperator.compute_parameter_mapping(
        params, model
    ).items():
        G = state["gradient_covariances"][name]
        A = state["input_covariances"][name]
        for role, index in roles.items():
            blocks[index] = [G] if role == "bias" else [G, A]
    return [blocks[i] for i in range(len(params))]


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("name", ["bert", "vit", "gpt2-lora", "bert-regression"])
def test_kfac_equals_curvlinops_on_token_linears(name, approx):
    """Linear layers on (B, T, D): queries, keys, values, MLPs, LoRA's A and B."""
    case = ZOO[name]
    model = case.model()
    x, y = case.batch()
    params = _linear_params(model)
    lossfunc, factor = ref.loss_and_factor(case.likelihood)
    expected = _curvlinops_kron(model, lossfunc, params, x, y, approx)
    expected = [[factor ** (1 / len(b)) * f for f in b] for b in expected]
    got = ref.kfac_factors(model, [(x, y)], case.likelihood, params, approx)
    assert sorted(got) == list(range(len(params)))
    ref.assert_kron_close([got[i] for i in range(len(params))], expected, RTOL)


class _TokenNet(nn.Module):
    """Embedding -> HF Conv1D -> tanh -> mean over tokens -> Linear; or its twin.

    The twin computes the same function with ``nn.Linear`` layers only (one-hot
    inputs into a bias-free Linear for the embedding, the transposed Conv1D
    weight), which curvlinops factorises.
    """

    def __init__(self, twin: bool = False) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        torch.manual_seed(0)
        self.twin = twin
        self.emb = nn.Embedding(7, 4)
        self.proj = Conv1D(5, 4)  # weight (in=4, out=5)
        nn.init.normal_(self.proj.weight)
        nn.init.normal_(self.proj.bias)
        self.head = nn.Linear(5, 3)
        if twin:
            emb, proj = self.emb, self.proj
            self.emb = nn.Linear(7, 4, bias=False)
            self.proj = nn.Linear(4, 5)
            with torch.no_grad():
                self.emb.weight.copy_(emb.weight.T)
                self.proj.weight.copy_(proj.weight.T)
                self.proj.bias.copy_(proj.bias)
        self.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = F.one_hot(ids, 7).double() if self.twin else ids
        return self.head(torch.tanh(self.proj(self.emb(tokens))).mean(1))


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_embedding_and_conv1d_rules_equal_curvlinops_on_linear_twins(approx):
    """Embedding and Conv1D factors equal curvlinops' on the Linear twin (swapped:
    their weights are the twin's transposed, so are the factors' roles)."""
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 7, (4, 6), generator=gen), zoo.labels(4, 3)
    model, twin = _TokenNet(), _TokenNet(twin=True)
    loss = nn.CrossEntropyLoss(reduction="sum")
    expected = _curvlinops_kron(twin, loss, list(twin.parameters()), x, y, approx)
    expected = [b[::-1] for b in expected[:2]] + expected[2:]  # emb, proj weights
    got = ref.kron_reference(model, [(x, y)], "classification", kfac_approx=approx)
    ref.assert_kron_close(got, expected, RTOL)


@likelihoods
@sequential
def test_kfac_equals_backpack_kflr(make_model, input_shape, likelihood):
    """Linear and Conv1d/2d/3d factors equal laplace-torch's BackPackGGN.kron."""
    model, x, y = _sequential_case(make_model, input_shape, likelihood)
    with upstream_quiet():
        loss, kron = BackPackGGN(copy.deepcopy(model), likelihood).kron(x, y, N=5)
    expected = ref.kron_reference(model, [(x, y)], likelihood)
    ref.assert_kron_close(kron.kfacs, expected, RTOL)


def _output_positions(model: nn.Module, x, convs) -> dict[nn.Module, int]:
    """Number of output positions of each convolution for one sample."""
    sizes: dict[nn.Module, int] = {}
    handles = [
        c.register_forward_hook(
            lambda m, args, out: sizes.__setitem__(m, out[0, 0].numel())
        )
        for c in convs
    ]
    try:
        with torch.no_grad():
            model(x[:1])
    finally:
        for handle in handles:
            handle.remove()
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize("case", zoo.TORCHVISION_CASES, ids=lambda c: c.name)
def test_conv_kflr_equals_curvlinops_on_torchvision(case):
    """ResNet and MobileNetV3 (in-place ReLU, ``out += identity``, SE blocks).

    BackPACK's KFLR ``G`` is curvlinops' KFAC-reduce gradient covariance, its ``A``
    curvlinops' KFAC-expand input covariance times the number of output positions.
    Both run Hardsigmoid as ``relu6(x + 3) / 6``: PyTorch's float64 kernel
    differentiates with float32's 1/6, which moves curvlinops' factors by 7e-8.
    """
    model, (x, y) = case.model(), case.batch()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups == 1]
    params = [p for conv in convs for p in conv.parameters()]
    loss = nn.CrossEntropyLoss(reduction="sum")
    with reference_forward(model):
        states = {
            approx: _curvlinops_state(model, loss, params, x, y, approx)
            for approx in ("expand", "reduce")
        }
    positions = _output_positions(model, x, convs)
    got = ref.kfac_factors(model, [(x, y)], case.likelihood, params)
    mapping = KFACLinearOperator.compute_parameter_mapping(params, model)
    for name, roles in mapping.items():
        G = states["reduce"]["gradient_covariances"][name]
        A = states["expand"]["input_covariances"][name]
        A = A * positions[model.get_submodule(name)]
        for role, index in roles.items():
            expected = [G] if role == "bias" else [G, A]
            for a, e in zip(got[index], expected):
                torch.testing.assert_close(a, e, rtol=RTOL, atol=RTOL * e.abs().max())


def test_kfac_sums_batches_as_curvlinops_does():
    """Two batches: sums of the factors over batches, A normalised by all N."""
    case = ZOO["bert"]
    model = case.model()
    x, y = case.batch()
    halves = [
        ({k: v[:2] for k, v in x.items()}, y[:2]),
        ({k: v[2:] for k, v in x.items()}, y[2:]),
    ]
    params = _linear_params(model)
    whole = ref.kfac_factors(model, [(x, y)], "classification", params)
    parts = ref.kfac_factors(model, halves, "classification", params)
    for i in whole:
        for a, b in zip(parts[i], whole[i]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# --- Nearest Kronecker product


def _spd(n: int, gen: torch.Generator) -> torch.Tensor:
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    return a @ a.T + torch.eye(n)


def test_nearest_kronecker_product_of_a_kronecker_product_is_itself():
    gen = torch.Generator().manual_seed(0)
    A, B = _spd(3, gen), _spd(4, gen)
    F0, F1 = ref.nearest_kronecker_product(torch.kron(A, B), 3, 4)
    torch.testing.assert_close(torch.kron(F0, F1), torch.kron(A, B), rtol=1e-12, atol=0)
    alpha = (F0 * A).sum() / (A * A).sum()
    torch.testing.assert_close(F0, alpha * A, rtol=1e-12, atol=0)


@pytest.mark.parametrize(("m", "n"), [(3, 5), (6, 2)])
def test_nearest_kronecker_product_equals_dense_svd(m, n):
    """The Gram route equals the rank-1 SVD of the rearranged block; it is optimal."""
    gen = torch.Generator().manual_seed(1)
    H = _spd(m * n, gen)
    R = H.reshape(m, n, m, n).permute(0, 2, 1, 3).reshape(m * m, n * n)
    U, s, Vh = torch.linalg.svd(R)
    dense = torch.kron(s[0] * U[:, 0].reshape(m, m), Vh[0].reshape(n, n))
    F0, F1 = ref.nearest_kronecker_product(H, m, n)
    torch.testing.assert_close(torch.kron(F0, F1), dense, rtol=1e-12, atol=1e-12)
    best = (H - torch.kron(F0, F1)).norm()
    for _ in range(5):  # no nearby Kronecker product is nearer
        d0 = 1e-3 * torch.randn(m, m, generator=gen, dtype=torch.float64)
        d1 = 1e-3 * torch.randn(n, n, generator=gen, dtype=torch.float64)
        assert best < (H - torch.kron(F0 + d0, F1 + d1)).norm()


# --- Exact GGN and EF


@likelihoods
@sequential
def test_ggn_and_ef_equal_backpack(make_model, input_shape, likelihood):
    """DiagGGNExact, SumGradSquared and the per-sample-gradient EF of BackPACK."""
    model, x, y = _sequential_case(make_model, input_shape, likelihood)
    batches = [(x, y)]
    with upstream_quiet():
        diag = BackPackGGN(copy.deepcopy(model), likelihood).diag(x, y)[1]
        ef_diag = BackPackEF(copy.deepcopy(model), likelihood).diag(x, y)[1]
        ef_full = BackPackEF(copy.deepcopy(model), likelihood).full(x, y)[1]
    exact = ref.exact_ggn(model, batches, likelihood)
    torch.testing.assert_close(exact.diagonal, diag, rtol=RTOL, atol=1e-14)
    ef = ref.ef_diagonal(model, batches, likelihood)
    torch.testing.assert_close(ef, ef_diag, rtol=RTOL, atol=1e-14)
    full = ref.ef_full(model, batches, likelihood)
    torch.testing.assert_close(full, ef_full, rtol=RTOL, atol=1e-14)


def _blocks_of(H: torch.Tensor, params) -> list[torch.Tensor]:
    sizes = [p.numel() for p in params]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [H[s : s + n, s : s + n] for s, n in zip(starts, sizes)]


def _check_exact_against_full(model, batches, likelihood, H):
    params = ref.trainable(model)
    exact = ref.exact_ggn(model, batches, likelihood, blocks=range(len(params)))
    atol = RTOL * H.abs().max()
    torch.testing.assert_close(exact.diagonal, H.diagonal(), rtol=RTOL, atol=atol)
    for i, block in enumerate(_blocks_of(H, params)):
        torch.testing.assert_close(exact.blocks[i], block, rtol=RTOL, atol=atol)


@pytest.mark.parametrize("name", ["vit", "mlp-C3", "cnn-C3"])
def test_ggn_equals_diff_func_ggn_full(name):
    """``vmap(jacrev)`` (where DiffFuncGGN works) against both loop references."""
    likelihood = "classification"
    if name == "vit":
        model, (x, y) = ZOO[name].model(), ZOO[name].batch()
    else:
        case = next(c for c in CASES if c.name == name)
        model, x, y = case.model(), case.inputs(5), zoo.labels(5, case.n_outputs)
    H = DiffFuncGGN(model, likelihood).full(x, y)[1]
    full = ref.ggn_full(model, [(x, y)], likelihood)
    torch.testing.assert_close(full, H, rtol=RTOL, atol=RTOL * H.abs().max())
    _check_exact_against_full(model, [(x, y)], likelihood, H)


@pytest.mark.parametrize("name", ["gpt2-sdpa", "bert-regression", "gpt2-lora"])
def test_streamed_ggn_equals_loop_jacobian_ggn(name):
    """``J^T s`` per column of ``S`` (exact_ggn) against ``J^T Lambda J`` (ggn_full)."""
    case = ZOO[name]
    model, batch = case.model(), case.batch()
    H = ref.ggn_full(model, [batch], case.likelihood)
    _check_exact_against_full(model, [batch], case.likelihood, H)


def test_last_layer_reference_on_two_dimensional_features():
    """BERT's classifier sees (B, D): its last-layer GGN is the model's block."""
    case = ZOO["bert"]
    model, (x, y) = case.model(), case.batch()
    head = model.hf_model.classifier
    phi, f = ref.last_layer_features(model, x, head)
    H = ref.ggn_full(head, [(phi, y)], "classification", hessian_outputs=[f])
    params = list(head.parameters())
    expected = ref.ggn_full(model, [(x, y)], "classification", params)
    torch.testing.assert_close(H, expected, rtol=RTOL, atol=RTOL * H.abs().max())
    kron = ref.kron_reference(head, [(phi, y)], "classification", hessian_outputs=[f])
    model_kron = ref.kron_reference(model, [(x, y)], "classification", params)
    ref.assert_kron_close(kron, model_kron, RTOL)
