"""Deep-MLP proxy: shapes, cut candidates, both datasets, a few steps of learning."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from erase_tune.errors import WorkloadError
from erase_tune.workloads import get_workload
from erase_tune.workloads.mlp import DeepMLP, cut_candidates
from tests.workloads.training import train

CPU = torch.device("cpu")


def test_cut_candidates() -> None:
    assert cut_candidates(30) == (
        "layers.0:10", "layers.10:20", "layers.20:30",
        "layers.0", "layers.5", "layers.10", "layers.15", "layers.20", "layers.25",
    )  # fmt: skip
    assert cut_candidates(2) == ("layers.0:1", "layers.1:2", "layers.0", "layers.1")
    assert cut_candidates(1) == ("layers.0:1", "layers.0")


@pytest.mark.parametrize("dataset", ["digits", "synthetic"])
def test_shapes_and_determinism(dataset: str) -> None:
    wl = get_workload("mlp", {"dataset": dataset, "depth": 6, "batch": 64})
    assert wl.args["dataset"] == dataset
    model = wl.build_model()
    assert isinstance(model, DeepMLP) and len(model.layers) == 6
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
    assert after < before and after < 0.8
