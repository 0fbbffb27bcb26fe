"""Workload arguments are bounded, and sizes no machine here could hold are refused at once.

Each refusal must come from the factory, before the model or the data are allocated: one
line naming the arguments and the part they size, in well under a second, without the
process's memory growing (measured in a fresh interpreter, see ``footprint``).
"""

from __future__ import annotations

import re

import pytest
import torch

from erase_tune.errors import WorkloadError
from erase_tune.workloads import get_workload
from erase_tune.workloads.limits import format_bytes, host_memory_bytes
from tests.workloads.footprint import measure

MB = 10**6

ABSURD = [
    ("ctr", {"rows": 10**12},
     r"num_tables=26 x rows=1000000000000 x emb_dim=16 needs about 6.7 PB for the embedding tables"),
    ("ctr", {"width": 2**16, "depth": 64}, r"width=65536, depth=64, .* for the dense layers"),
    ("ctr", {"batch": 2**20, "train_batches": 2**20},
     r"batch=1048576 x \(train_batches=1048576 \+ eval_batches=8\) needs about .* for the train/eval pools"),
    ("ctr", {"num_tables": 1024, "rows": 2**30, "emb_dim": 1},
     r"num_tables=1024 x rows=1073741824 needs about .* popularity order"),
    ("gpt", {"n_layer": 256, "n_head": 1, "n_embd": 2**16},
     r"n_layer=256, n_embd=65536, seq_len=64 needs about .* for the model"),
    ("gpt", {"batch": 2**20, "seq_len": 2**17}, r"batch=1048576 x seq_len=131072 x .* for the train/eval pools"),
    ("mlp", {"width": 2**16, "depth": 1024}, r"depth=1024, width=65536 needs about .* for the model"),
    ("mlp", {"batch": 2**20, "train_batches": 2**20}, r"for the train/eval pools"),
    ("dlrm", {"rows": 10**12}, r"num_tables=26 x rows=1000000000000 x emb_dim=128 needs about 13 PB for the embedding"),
    ("dlrm", {"top_mlp": "-".join(["65536"] * 63 + ["1"])}, r"top_mlp='65536-.*-1', .* for the MLPs"),
]  # fmt: skip

# Every integer argument at its upper bound at once: the most a factory can be asked to size.
MAXIMA = [
    ("ctr", {"batch": 2**20, "width": 2**16, "depth": 64, "emb_dim": 2**14, "num_tables": 1024, "rows": 2**40,
             "bag": 1024, "sub_out": 2**16, "train_batches": 2**20, "eval_batches": 2**20, "seed": 2**32 - 1}),
    ("gpt", {"batch": 2**20, "seq_len": 2**17, "n_layer": 256, "n_head": 2**12, "n_embd": 2**16,
             "train_batches": 2**20, "eval_batches": 2**20, "seed": 2**32 - 1}),
    ("mlp", {"batch": 2**20, "width": 2**16, "depth": 1024, "train_batches": 2**20, "eval_batches": 2**20,
             "seed": 2**32 - 1}),
    ("dlrm", {"batch": 2**20, "rows": 2**40, "emb_dim": 2**14, "num_tables": 1024, "train_batches": 2**20,
              "eval_batches": 2**20, "seed": 2**32 - 1, "bot_mlp": "-".join(["65536"] * 63 + ["16384"]),
              "top_mlp": "-".join(["65536"] * 63 + ["1"])}),
]  # fmt: skip


@pytest.fixture(scope="module")
def refusals() -> list[dict]:
    cases = [{"name": n, "args": a, "example": False} for n, a, _ in ABSURD]
    cases += [{"name": n, "args": a, "example": False} for n, a in MAXIMA]
    return measure(cases)


@pytest.mark.parametrize("i", range(len(ABSURD)), ids=[f"{n}-{'-'.join(a)}" for n, a, _ in ABSURD])
def test_absurd_sizes_are_refused_before_allocating(refusals: list[dict], i: int) -> None:
    name, _, match = ABSURD[i]
    result = refusals[i]
    message = result["error"]
    assert message is not None, "not refused"
    assert "\n" not in message and message.startswith(f"workload '{name}': ")
    assert re.search(match, message), message
    cap = format_bytes(host_memory_bytes())
    assert message.endswith(f"more than this machine's {cap} of memory")
    assert result["cpu_seconds"] < 1.0 and result["grew"] < 50 * MB, result


@pytest.mark.parametrize("i", range(len(MAXIMA)), ids=[n for n, _ in MAXIMA])
def test_every_argument_at_its_bound_is_refused_quickly(refusals: list[dict], i: int) -> None:
    result = refusals[len(ABSURD) + i]
    assert result["error"] is not None and "more than this machine's" in result["error"]
    assert result["cpu_seconds"] < 1.0 and result["grew"] < 50 * MB, result


def test_the_message_names_the_total_when_other_parts_matter() -> None:
    # Tables and pools of about the same size: neither alone says what was compared.
    memory = host_memory_bytes()
    rows = int(0.6 * memory / (26 * 16 * 16))  # 26 tables of 16 float32 + gradient + Adam moments
    train_batches = int(0.6 * memory / 4000 / 2**14)  # ~4 kB per example while the pools are built
    with pytest.raises(WorkloadError, match=r"for the (embedding tables|train/eval pools) \(.* in all\), more than"):
        get_workload("ctr", {"rows": rows, "batch": 2**14, "train_batches": train_batches})


BOUNDS = [
    ("ctr", "batch", 2**20), ("ctr", "width", 2**16), ("ctr", "depth", 64), ("ctr", "emb_dim", 2**14),
    ("ctr", "num_tables", 1024), ("ctr", "rows", 2**40), ("ctr", "bag", 1024), ("ctr", "sub_out", 2**16),
    ("ctr", "train_batches", 2**20), ("ctr", "eval_batches", 2**20),
    ("gpt", "batch", 2**20), ("gpt", "seq_len", 2**17), ("gpt", "n_layer", 256), ("gpt", "n_head", 2**12),
    ("gpt", "n_embd", 2**16), ("gpt", "train_batches", 2**20), ("gpt", "eval_batches", 2**20),
    ("mlp", "batch", 2**20), ("mlp", "width", 2**16), ("mlp", "depth", 1024), ("mlp", "train_batches", 2**20),
    ("mlp", "eval_batches", 2**20),
    ("dlrm", "batch", 2**20), ("dlrm", "rows", 2**40), ("dlrm", "emb_dim", 2**14), ("dlrm", "num_tables", 1024),
    ("dlrm", "train_batches", 2**20), ("dlrm", "eval_batches", 2**20),
]  # fmt: skip


@pytest.mark.parametrize(("name", "arg", "high"), BOUNDS, ids=[f"{n}-{a}" for n, a, _ in BOUNDS])
def test_integer_arguments_are_bounded(name: str, arg: str, high: int) -> None:
    prefix = rf"^workload '{name}': argument '{arg}' must be an integer"
    for value in (high + 1, 10**30):
        with pytest.raises(WorkloadError, match=rf"{prefix} <= {high}, got {value}$"):
            get_workload(name, {arg: value})
    with pytest.raises(WorkloadError, match=rf"{prefix} >= 1, got 0$"):
        get_workload(name, {arg: 0})


@pytest.mark.parametrize("name", ["ctr", "gpt", "mlp"])
def test_seeds_are_32_bit(name: str) -> None:
    with pytest.raises(WorkloadError, match=rf"^workload '{name}': argument 'seed' must be an integer >= 0, got -1$"):
        get_workload(name, {"seed": -1})
    with pytest.raises(WorkloadError, match=r"argument 'seed' must be an integer <= 4294967295, got 4294967296$"):
        get_workload(name, {"seed": 2**32})
    # The largest seed builds, and a seed still decides the initialisation.
    top = get_workload(name, {"seed": 2**32 - 1}).build_model().state_dict()
    zero = get_workload(name, {"seed": 0}).build_model().state_dict()
    assert any(not torch.equal(top[k], zero[k]) for k in top if top[k].is_floating_point())


def test_format_bytes() -> None:
    assert format_bytes(6.656e15) == "6.7 PB"
    assert format_bytes(25_276_502_016) == "25 GB"
    assert format_bytes(999) == "999 B" and format_bytes(999.6) == "1 kB"


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("ctr", {}), ("ctr", {"depth": 1, "width": 7, "emb_dim": 3, "num_tables": 4, "rows": 11, "sub_out": 5}),
        ("ctr", {"depth": 4, "width": 1, "emb_dim": 6, "num_tables": 1, "rows": 2, "sub_out": 1}),
        ("gpt", {}), ("gpt", {"n_layer": 1, "n_head": 3, "n_embd": 9, "seq_len": 5}),
        ("mlp", {}), ("mlp", {"depth": 1, "width": 3, "layer_norm": False}), ("mlp", {"depth": 5, "width": 70}),
    ],
)  # fmt: skip
def test_the_estimate_counts_the_model_that_is_built(name: str, args: dict) -> None:
    # The estimate counts parameters by formula (building a model to count them is too slow
    # at the bounds); it must agree with the model the workload builds.
    import importlib

    wl = get_workload(name, args)
    counted = importlib.import_module(f"erase_tune.workloads.{name}")._parameter_count(dict(wl.args))
    built = sum(p.numel() for p in wl.build_model().parameters())
    assert (sum(counted) if isinstance(counted, tuple) else counted) == built
