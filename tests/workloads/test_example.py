"""``Workload.example``: one batch like a training batch, cheap at GPU sizes.

The tuning service probes each job's model with ``workload.example(torch.device("cpu"))``
before any trial runs; it must be as valid an input as a real batch and must not build the
train pool (gigabytes at GPU sizes).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from erase_tune.errors import WorkloadError
from erase_tune.workloads import Batch, Workload, WorkloadData, get_workload
from tests.workloads.footprint import measure
from tests.workloads.test_criteo import _write_tsv

CPU = torch.device("cpu")
MB = 10**6

SMALL = {
    "ctr": {"batch": 32, "width": 16, "depth": 2, "emb_dim": 8, "num_tables": 5, "rows": 50, "sub_out": 4, "bag": 3},
    "gpt": {"batch": 4, "seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
    "mlp": {"batch": 64, "depth": 4},
    "mlp-synthetic": {"batch": 64, "depth": 4, "dataset": "synthetic"},
    "dlrm": {"batch": 32, "rows": 50, "emb_dim": 4, "num_tables": 5, "bot_mlp": "16-4", "top_mlp": "16-1"},
}

# The sizes GPU trials use; their full pools are gigabytes (ctr: over a million examples).
GPU = [
    ("ctr", {"batch": 2048, "num_tables": 26, "rows": 100_000, "emb_dim": 64, "width": 256, "train_batches": 512}),
    ("gpt", {"batch": 32, "seq_len": 1024, "n_layer": 12, "n_head": 6, "n_embd": 768, "train_batches": 512}),
    ("mlp", {"batch": 512, "width": 1024, "depth": 30, "train_batches": 512}),
    # MLPerf's shape (the defaults); at ctr's batch, since the per-table id order (26 x 100,000)
    # costs the same for both and is most of the time (~0.5 s at any batch, more under load).
    ("dlrm", {"batch": 2048, "train_batches": 512}),
]


def _layout(batch: Batch) -> list[tuple[tuple[int, ...], torch.dtype]]:
    inputs, target = batch
    return [(tuple(t.shape), t.dtype) for t in (*inputs, target)]


def _check_values(name: str, wl: Workload, batch: Batch) -> None:
    """The values a real batch of ``name`` can hold: ids in range, labels in the label set."""
    inputs, target = batch
    if name == "ctr":
        _, sparse = inputs
        assert 0 <= int(sparse.min()) and int(sparse.max()) < wl.args["rows"]
        assert set(target.unique().tolist()) <= {0.0, 1.0}
    elif name == "dlrm":
        _, offsets, ids = inputs
        assert 0 <= int(ids.min()) and int(ids.max()) < wl.args["rows"]
        assert torch.equal(offsets, torch.arange(len(target)).expand_as(offsets))
        assert set(target.unique().tolist()) <= {0.0, 1.0}
    elif name == "gpt":
        (idx,) = inputs
        assert 0 <= int(idx.min()) and int(idx.max()) < 256 and torch.equal(idx[:, 1:], target[:, :-1])
    else:
        (x,) = inputs
        assert torch.isfinite(x).all() and 0 <= int(target.min()) and int(target.max()) < 10


@pytest.mark.parametrize("key", list(SMALL))
def test_example_is_like_a_training_batch(key: str) -> None:
    name = key.split("-")[0]
    wl = get_workload(name, SMALL[key])
    example = wl.example(CPU)
    real = wl.make_data(CPU).batch(0)
    assert _layout(example) == _layout(real)
    _check_values(name, wl, example)
    inputs, target = example
    with torch.no_grad():
        assert math.isfinite(wl.loss_fn(wl.build_model()(*inputs), target).item())


def test_digits_example_is_the_first_training_batch() -> None:
    wl = get_workload("mlp", {"batch": 100, "train_batches": 30})  # 3000 images: two passes over digits
    (x,), y = wl.example(CPU)
    (real_x,), real_y = wl.make_data(CPU).batch(0)
    assert torch.equal(x, real_x) and torch.equal(y, real_y)


def test_criteo_example_is_the_first_training_batch(tmp_path: Path) -> None:
    path = _write_tsv(tmp_path / "day.tsv", 300)
    wl = get_workload("ctr", {"data": str(path), "batch": 32, "rows": 100, "train_batches": 8, "eval_batches": 2})
    example, real = wl.example(CPU), wl.make_data(CPU).batch(0)
    assert all(torch.equal(a, b) for a, b in zip((*example[0], example[1]), (*real[0], real[1])))
    short = get_workload("ctr", {"data": str(path), "batch": 512})
    with pytest.raises(WorkloadError, match=r"has 300 lines, too few for one training batch of 512"):
        short.example(CPU)


def test_without_make_example_the_first_batch_is_used() -> None:
    calls = []

    def make_data(device: torch.device) -> WorkloadData:
        calls.append(device)
        x = torch.arange(6.0, device=device).view(3, 2)
        return WorkloadData(train=[((x,), x[:, 0])], eval=[((x,), x[:, 0])], prior_entropy=1.0)

    wl = Workload(name="user", args={}, build_model=lambda: nn.Linear(2, 1), loss_fn=F.mse_loss,
                  make_data=make_data, cut_candidates=(), batch_size=3)  # fmt: skip
    (x,), target = wl.example(CPU)
    assert calls == [CPU] and torch.equal(x, torch.arange(6.0).view(3, 2)) and torch.equal(target, x[:, 0])


def test_make_example_is_used_when_given() -> None:
    def fail(device: torch.device) -> WorkloadData:
        raise AssertionError("make_data must not run when make_example is given")

    one: Tensor = torch.ones(2, 2)
    wl = Workload(
        name="user", args={}, build_model=lambda: nn.Linear(2, 1), loss_fn=F.mse_loss, make_data=fail,
        cut_candidates=(), batch_size=2, make_example=lambda device: ((one.to(device),), one[:, 0]),
    )  # fmt: skip
    (x,), _ = wl.example(CPU)
    assert torch.equal(x, one)


@pytest.fixture(scope="module")
def gpu_sized_examples() -> list[dict]:
    return measure([{"name": name, "args": args, "example": True} for name, args in GPU])


@pytest.mark.parametrize("i", range(len(GPU)), ids=[name for name, _ in GPU])
def test_example_is_cheap_at_gpu_sizes(gpu_sized_examples: list[dict], i: int) -> None:
    # Building the workload and its example, in a fresh process: well under a second and
    # tens of MB (ctr: the per-table id order, 26 x 100,000), not the pool's gigabytes.
    result = gpu_sized_examples[i]
    assert result["error"] is None, result["error"]
    assert result["cpu_seconds"] < 1.5 and result["grew"] < 200 * MB, result
