"""Deep-MLP proxy: shapes, cut candidates, both datasets, a few steps of learning."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

from erase_tune.errors import WorkloadError
from erase_tune.workloads import get_workload
from erase_tune.workloads.mlp import NUM_FEATURES, DeepMLP, InputBlock, MLPBlock, cut_candidates
from tests.workloads.training import train

CPU = torch.device("cpu")
SHIPPED_SPACE = Path(__file__).resolve().parents[2] / "search_spaces" / "mlp.yaml"


def test_cut_candidates() -> None:
    # layers.0 is the input projection: the first third of the hidden blocks comes with it.
    assert cut_candidates(30) == (
        "layers.0:11", "layers.11:21", "layers.21:31",
        "layers.1", "layers.6", "layers.11", "layers.16", "layers.21", "layers.26",
    )  # fmt: skip
    assert cut_candidates(6) == (
        "layers.0:3", "layers.3:5", "layers.5:7",
        "layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "layers.6",
    )  # fmt: skip
    assert cut_candidates(2) == ("layers.0:2", "layers.2:3", "layers.1")
    assert cut_candidates(1) == ("layers.0:1", "layers.1:2")


def test_input_projection_is_the_chains_first_block() -> None:
    model = get_workload("mlp", {"depth": 3, "dataset": "synthetic"}).build_model()
    first, *hidden = model.layers
    assert isinstance(first, InputBlock) and first.linear.in_features == NUM_FEATURES
    assert len(hidden) == 3 and all(isinstance(b, MLPBlock) for b in hidden)
    x = torch.randn(5, NUM_FEATURES)
    with torch.no_grad():
        chained = torch.relu(first.linear(x))
        for block in hidden:
            chained = block(chained)
        assert torch.equal(model(x), model.head(chained))


def test_each_matrix_keeps_its_adam_step() -> None:
    # The input projection (fan-in 64) keeps lr, hidden matrices step at lr * 64 / width,
    # vectors (biases, norm gains) keep lr, whatever chain they sit in.
    wl = get_workload("mlp", {"width": 256, "depth": 2, "lr": 1e-3, "dataset": "synthetic"})
    model = wl.build_model()
    step = {id(p): g["lr"] for g in wl.optimizer(model.parameters()).param_groups for p in g["params"]}
    lrs = {name: step[id(p)] for name, p in model.named_parameters()}
    assert lrs["layers.0.linear.weight"] == lrs["layers.0.linear.bias"] == 1e-3
    assert lrs["layers.1.linear.weight"] == lrs["layers.2.linear.weight"] == lrs["head.weight"] == 1e-3 / 4
    assert lrs["layers.1.norm.weight"] == lrs["layers.1.linear.bias"] == lrs["head.bias"] == 1e-3


@pytest.mark.parametrize("dataset", ["digits", "synthetic"])
def test_shapes_and_determinism(dataset: str) -> None:
    wl = get_workload("mlp", {"dataset": dataset, "depth": 6, "batch": 64})
    assert wl.args["dataset"] == dataset
    model = wl.build_model()
    assert isinstance(model, DeepMLP) and len(model.layers) == 7  # the input projection, then 6 blocks
    data = wl.make_data(CPU)
    (x,), y = data.batch(0)
    assert x.shape == (64, 64) and x.dtype == torch.float32 and y.shape == (64,) and y.dtype == torch.int64
    assert model(x).shape == (64, 10)
    assert len(data.train) == 8 and 1 <= len(data.eval) <= 4
    a, b = model.state_dict(), wl.build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    again = wl.make_data(CPU)
    assert all(torch.equal(u[0][0], v[0][0]) for u, v in zip(data.train, again.train))
    for name in wl.cut_candidates:
        assert name.split(":")[0] in dict(model.named_modules())


def test_digits_held_out_is_separate() -> None:
    wl = get_workload("mlp", {"batch": 128})
    data = wl.make_data(CPU)
    train = {tuple(row) for (x,), _ in data.train for row in x.tolist()}
    held = [tuple(row) for (x,), _ in data.eval for row in x.tolist()]
    assert len(held) == 359 or len(held) == 360  # 20% of 1797 images, each used once
    # Digits has a few duplicate images, so allow a handful of coincidences.
    assert sum(row in train for row in held) < 10


def test_digits_without_sklearn_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    with pytest.raises(WorkloadError, match=r"dataset 'digits' needs scikit-learn"):
        get_workload("mlp", {"dataset": "digits"})
    assert get_workload("mlp", {"dataset": "synthetic"}).args["dataset"] == "synthetic"


@pytest.mark.parametrize("layer_norm", [True, False])
def test_few_steps_reduce_loss(layer_norm: bool) -> None:
    wl = get_workload("mlp", {"layer_norm": layer_norm, "dataset": "digits"})
    data = wl.make_data(CPU)
    model = wl.build_model()
    before = wl.normalized_entropy(model, data)
    train(wl, data, model, 40)
    after = wl.normalized_entropy(model, data)
    assert after < before and after < 0.85  # 40 steps: 0.80 on one CPU, 0.80-0.81 on another


def test_shipped_depth_and_lr_learn_where_one_adam_step_size_collapsed() -> None:
    # The shipped space trains width 1024 (too slow here). Its depth, batch and lr at width
    # 256 failed the same way with one Adam step size for every layer (held-out NE 0.55-0.83
    # over 300 steps); scaled per fan-in they reach ~0.07 in 100 steps.
    shipped = yaml.safe_load(SHIPPED_SPACE.read_text())["workload"]["args"]
    assert shipped["depth"] == 30 and shipped["width"] >= 256
    wl = get_workload("mlp", {**shipped, "width": 256})
    data = wl.make_data(CPU)
    model = wl.build_model()
    train(wl, data, model, 100)
    assert wl.normalized_entropy(model, data) < 0.3
