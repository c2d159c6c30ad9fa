"""Bad input to the location optimiser and the objective: clear errors, before work."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from laplace_diffjac import DiffBackPackGGN
from laplace_diffjac.context import (
    LocationSettings,
    nystrom_gap,
    optimize_locations,
    random_subset,
)
from laplace_diffjac.context.locations._minibatches import stream_seed
from laplace_diffjac.errors import InvalidInputError
from laplace_diffjac.kernels import output_hessians
from tests.conftest import CASES
from tests.references import assert_same_state, model_state

MLP = CASES[1]  # mlp-C3, float64, inputs (3,)


class _CountingModel(torch.nn.Sequential):
    """The MLP case, counting forward calls (none may happen before an error)."""

    calls = 0

    def forward(self, x):  # noqa: D102
        type(self).calls += 1
        return super().forward(x)


def _model():
    torch.manual_seed(0)
    _CountingModel.calls = 0
    return _CountingModel(*MLP.make_model(3)).double().eval()


def _run(model=None, x=None, **overrides):
    model = _model() if model is None else model
    x = MLP.inputs(20, seed=3) if x is None else x
    kwargs = dict(m=3, init="random", steps=2, batch_size=5, progress_bar=False)
    kwargs.update(overrides)
    likelihood = kwargs.pop("likelihood", "regression")
    return optimize_locations(model, likelihood, x, **kwargs)


BAD_OPTIONS = {
    "likelihood": ({"likelihood": "poisson"}, "likelihood"),
    "steps": ({"steps": -1}, "steps"),
    "m-zero": ({"m": 0}, "m "),
    "m-above-N": ({"m": 21}, "m "),
    "batch_size": ({"batch_size": 0}, "batch_size"),
    "lr-zero": ({"lr": 0.0}, "lr"),
    "lr-negative": ({"lr": -1e-3}, "lr"),
    "init-string": ({"init": "sobol"}, "init"),
    "init-shape": ({"init": torch.zeros(3, 4, dtype=torch.float64)}, "init"),
    "init-dtype": ({"init": torch.zeros(3, 3, dtype=torch.float32)}, "init.to"),
    "init-nonfinite": (
        {"init": torch.tensor([[0.0, float("nan"), 0.0]] * 3, dtype=torch.float64)},
        "init",
    ),
    "jitter": ({"jitter": -1.0}, "jitter"),
    "patience": ({"patience": -2}, "patience"),
    "chunk_size": ({"chunk_size": 0}, "chunk_size"),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_option_raises_before_any_forward_pass(case):
    overrides, name = BAD_OPTIONS[case]
    model = _model()
    before = model_state(model)
    with pytest.raises(InvalidInputError, match=name):
        _run(model, **overrides)
    assert _CountingModel.calls == 0
    assert_same_state(before, model_state(model))


def test_nonfinite_training_inputs():
    x = MLP.inputs(20, seed=3)
    x[4, 1] = float("inf")
    with pytest.raises(InvalidInputError, match="data holds 1 non-finite"):
        _run(x=x)
    assert _CountingModel.calls == 0


def test_training_inputs_of_the_wrong_feature_shape():
    x = torch.randn(20, 5, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match=r"data has feature shape \(5,\)"):
        _run(x=x, init="random")


def test_float64_locations_for_a_float32_model():
    model = _model().float()
    x = MLP.inputs(20, seed=3).float()
    with pytest.raises(InvalidInputError, match=r"init.to\(torch.float32\)"):
        _run(model, x, init=torch.zeros(3, 3, dtype=torch.float64))


def test_locations_on_another_device():
    init = torch.zeros(3, 3, dtype=torch.float64, device="meta")
    with pytest.raises(InvalidInputError, match="init is on meta"):
        _run(init=init)


def _gap_args():
    model = MLP.model()
    x = MLP.inputs(6, seed=1)
    lam = output_hessians(model(x).detach(), "regression")
    return DiffBackPackGGN(model, "regression"), x, MLP.inputs(2, seed=2), lam


def test_gap_nonfinite_locations():
    backend, x, z, lam = _gap_args()
    z[0, 0] = float("nan")
    with pytest.raises(InvalidInputError, match="locations holds 1 non-finite"):
        nystrom_gap(backend, x, z, lam)


def test_gap_nonfinite_inputs():
    backend, x, z, lam = _gap_args()
    x[0, 0] = float("nan")
    with pytest.raises(InvalidInputError, match="x holds 1 non-finite"):
        nystrom_gap(backend, x, z, lam)


def test_gap_locations_of_the_wrong_feature_shape():
    backend, x, _, lam = _gap_args()
    with pytest.raises(InvalidInputError, match="locations have feature shape"):
        nystrom_gap(backend, x, torch.zeros(2, 4, dtype=torch.float64), lam)


def test_gap_inputs_the_model_does_not_accept():
    backend, _, _, _ = _gap_args()
    x, z = torch.zeros(6, 5).double(), torch.zeros(2, 5).double()
    lam = torch.eye(3).double().expand(6, 3, 3)
    with pytest.raises(InvalidInputError, match="does not accept"):
        nystrom_gap(backend, x, z, lam)


def test_gap_locations_in_another_dtype():
    backend, x, z, lam = _gap_args()
    with pytest.raises(InvalidInputError, match=r"locations.to\(torch.float64\)"):
        nystrom_gap(backend, x, z.float(), lam)


def test_gap_hessians_of_the_wrong_shape():
    backend, x, z, lam = _gap_args()
    with pytest.raises(InvalidInputError, match="hessians"):
        nystrom_gap(backend, x, z, lam[:-1])


def test_initialisation_and_minibatches_use_independent_streams():
    """A random subset drawn with seed s, and seed=s: the first batch is not Z."""
    s, m = 7, 6
    model = MLP.model()
    x = MLP.inputs(40, seed=5)
    z0 = random_subset(x, m, torch.Generator().manual_seed(s))
    result = optimize_locations(
        model,
        "regression",
        x,
        m,
        init=z0,
        seed=s,
        steps=1,
        batch_size=m,
        progress_bar=False,
        evaluate_full=True,
    )
    # Were the first batch the locations, the estimate would be ~0 (exactly 0
    # without jitter). It is a clear fraction of the full-data gap instead.
    assert result.history.objective[0] > 1e-2 * result.history.initial_objective
    first = torch.randperm(
        40, generator=torch.Generator().manual_seed(stream_seed(s, 1))
    )
    same_stream = torch.randperm(40, generator=torch.Generator().manual_seed(s))
    assert not torch.equal(first[:m].sort().values, same_stream[:m].sort().values)
    assert stream_seed(s, 1) != s and stream_seed(s, 1) != stream_seed(s + 1, 1)


def test_settings_object_equals_keywords_and_is_frozen():
    model = MLP.model()
    x = MLP.inputs(20, seed=3)
    kw = dict(steps=3, batch_size=7, seed=2, progress_bar=False, lr=0.01)
    a = optimize_locations(model, "regression", x, 3, init="random", **kw)
    settings = LocationSettings(**kw)
    b = optimize_locations(model, "regression", x, 3, init="random", settings=settings)
    torch.testing.assert_close(a.locations, b.locations, rtol=0, atol=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.steps = 5  # type: ignore[misc]
    with pytest.raises(InvalidInputError, match="steps"):
        LocationSettings(steps=-3)


def test_a_keyword_given_with_settings_is_honoured_also_at_its_default():
    model = MLP.model()
    x = MLP.inputs(20, seed=3)
    settings = LocationSettings(steps=3, patience=0, progress_bar=False)
    default_steps = LocationSettings().steps
    result = optimize_locations(
        model, "regression", x, 3, init="random", settings=settings,
        steps=default_steps,
    )  # fmt: skip
    assert len(result.history.objective) == default_steps
    short = optimize_locations(model, "regression", x, 3, settings=settings)
    assert len(short.history.objective) == 3
    assert settings.steps == 3  # the object itself is not changed


def test_an_unknown_option_is_refused_naming_the_fields():
    model = MLP.model()
    x = MLP.inputs(20, seed=3)
    with pytest.raises(InvalidInputError, match="stepz.*fields of LocationSettings"):
        optimize_locations(model, "regression", x, 3, stepz=3)
    with pytest.raises(InvalidInputError, match="settings must be a LocationSettings"):
        optimize_locations(model, "regression", x, 3, settings={"steps": 3})


def test_the_docstring_lists_every_option_with_its_default():
    import ast
    import re

    doc = optimize_locations.__doc__ or ""
    options = doc[doc.index("**options") : doc.index("Returns")]
    listed = dict(re.findall(r"``(\w+)=([^`]+)``", options))
    for field in dataclasses.fields(LocationSettings):
        assert field.name in listed, field.name
        assert ast.literal_eval(listed[field.name]) == field.default, field.name


def test_the_same_seed_with_a_shuffled_loader_gives_the_same_locations():
    from torch.utils.data import DataLoader, TensorDataset

    model = MLP.model()
    x = MLP.inputs(40, seed=3)
    loader = DataLoader(TensorDataset(x), batch_size=8, shuffle=True)
    kw = dict(init="random", steps=5, seed=4, progress_bar=False)
    a = optimize_locations(model, "regression", loader, 4, **kw)
    b = optimize_locations(model, "regression", loader, 4, **kw)
    c = optimize_locations(model, "regression", x, 4, **kw)
    torch.testing.assert_close(a.locations, b.locations, rtol=0, atol=0)
    torch.testing.assert_close(a.locations, c.locations, rtol=0, atol=0)


class _ThreadRecorder(torch.nn.Sequential):
    """The MLP case, recording PyTorch's threads at every forward pass."""

    seen: list = []

    def forward(self, x):  # noqa: D102
        type(self).seen.append(torch.get_num_threads())
        return super().forward(x)


@pytest.mark.parametrize("threads", [None, 2])
def test_small_steps_run_on_one_thread_and_the_setting_is_restored(threads):
    torch.manual_seed(0)
    model = _ThreadRecorder(*MLP.make_model(3)).double().eval()
    x = MLP.inputs(20, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _ThreadRecorder.seen = []
        optimize_locations(
            model, "regression", x, 3, steps=3, progress_bar=False, threads=threads,
            structured=False,
        )  # fmt: skip
        during = _ThreadRecorder.seen[-1]  # the last step's forward pass
        assert during == (1 if threads is None else 2)  # M C = 9 <= 256
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
