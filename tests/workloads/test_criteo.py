"""Criteo TSV reader, and the ctr workload trained on such a file."""

from __future__ import annotations

import math
import random
import zlib
from pathlib import Path

import pytest
import torch

from erase_tune.errors import WorkloadError
from erase_tune.workloads import get_workload
from erase_tune.workloads.criteo import load_criteo_tsv
from tests.workloads.training import train


def _line(label: str, ints: list[str], cats: list[str]) -> str:
    assert len(ints) == 13 and len(cats) == 26
    return "\t".join([label, *ints, *cats]) + "\n"


def _write_tsv(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        ints = ["" if rng.random() < 0.2 else str(rng.randint(-2, 500)) for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else f"{rng.getrandbits(32):08x}" for _ in range(26)]
        lines.append(_line(str(rng.randint(0, 1)), ints, cats))
    path.write_text("".join(lines))
    return path


def test_parses_values_and_empty_fields(tmp_path: Path) -> None:
    ints = ["3", "", "-5", "0", "1000"] + [""] * 8
    cats = ["68fd1e64", ""] + ["0a519c5c"] * 24
    path = tmp_path / "day.tsv"
    path.write_text(_line("1", ints, cats) + "\n" + _line("0", [""] * 13, [""] * 26).replace("\n", "\r\n"))
    dense, sparse, labels = load_criteo_tsv(path, rows=1000)
    assert dense.shape == (2, 13) and dense.dtype == torch.float32
    assert sparse.shape == (2, 26, 1) and sparse.dtype == torch.int64
    assert labels.tolist() == [1.0, 0.0] and labels.dtype == torch.float32
    expected = [math.log1p(3), 0.0, 0.0, 0.0, math.log1p(1000)]  # empty and negative → 0
    assert torch.allclose(dense[0, :5], torch.tensor(expected))
    assert sparse[0, 0, 0] == zlib.crc32(b"68fd1e64") % 1000  # not Python's salted hash()
    assert sparse[0, 1, 0] == 0 and torch.all(sparse[1] == 0) and torch.all(dense[1] == 0)


def test_hashes_are_in_range_and_max_lines(tmp_path: Path) -> None:
    path = _write_tsv(tmp_path / "day.tsv", 50)
    dense, sparse, labels = load_criteo_tsv(path, rows=7, max_lines=20)
    assert len(labels) == 20 and int(sparse.min()) >= 0 and int(sparse.max()) < 7
    again = load_criteo_tsv(path, rows=7, max_lines=20)
    assert torch.equal(sparse, again[1]) and torch.equal(dense, again[0])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("1\t2\t3\n", r"line 3: expected 40 tab-separated fields, got 3"),
        (_line("2", [""] * 13, [""] * 26), r"line 3: label must be 0 or 1, got '2'"),
        (_line("1", ["x1"] + [""] * 12, [""] * 26), r"line 3: integer feature I1 is not an integer: 'x1'"),
        # 400 digits: an int Python reads, past float's range (was an OverflowError traceback)
        (_line("1", [""] * 4 + ["9" * 400] + [""] * 8, [""] * 26),
         r"line 3: integer feature I5 is too large for a count: <an integer of 1329 bits>"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, bad: str, match: str) -> None:
    path = tmp_path / "bad.tsv"
    good = _line("0", [""] * 13, [""] * 26)
    path.write_text(good + good + bad + good)
    with pytest.raises(WorkloadError, match=match) as info:
        load_criteo_tsv(path, rows=10)
    assert "bad.tsv" in str(info.value) and "\n" not in str(info.value)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r"criteo file '.*nope.tsv': cannot read"):
        load_criteo_tsv(tmp_path / "nope.tsv", rows=10)
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(WorkloadError, match="no examples"):
        load_criteo_tsv(tmp_path / "empty.tsv", rows=10)


def test_ctr_workload_trains_on_a_tsv(tmp_path: Path) -> None:
    path = _write_tsv(tmp_path / "day.tsv", 300)
    args = {"data": str(path), "batch": 32, "width": 16, "emb_dim": 8, "rows": 100, "sub_out": 4,
            "train_batches": 8, "eval_batches": 2}  # fmt: skip
    wl = get_workload("ctr", args)
    data = wl.make_data(torch.device("cpu"))
    # 300 of the 320 lines asked for: the last 60 (the eval share, 64/320) are held out
    # and the other 240 give 7 full batches of 32.
    assert len(data.train) == 7 and all(len(y) == 32 for _, y in data.train)
    assert sum(len(y) for _, y in data.eval) == 60
    model = wl.build_model()
    losses = train(wl, data, model, 10)
    assert all(math.isfinite(x) for x in losses)
    assert math.isfinite(wl.normalized_entropy(model, data))


def test_ctr_refuses_shapes_criteo_cannot_give(tmp_path: Path) -> None:
    path = _write_tsv(tmp_path / "day.tsv", 10)
    with pytest.raises(WorkloadError, match=r"argument 'num_tables' must be 26 with Criteo data, got 8"):
        get_workload("ctr", {"data": str(path), "num_tables": 8})
    with pytest.raises(WorkloadError, match=r"argument 'bag' must be 1 with Criteo data"):
        get_workload("ctr", {"data": str(path), "bag": 2})
    wl = get_workload("ctr", {"data": str(path), "batch": 64})
    with pytest.raises(WorkloadError, match=r"has 10 lines, too few for one training batch of 64"):
        wl.make_data(torch.device("cpu"))
