"""Hostile plan files end in one line, fast, with little memory.

Each of these once cost far more than its size: a 30-byte run of 10^11 blocks was expanded
into names (out of memory), 20,000-block runs took 51 s to compare, a trillion streams hung
the engine, deep nesting and 5000-digit integers raised raw Python errors, mixed-type keys
a TypeError, a recursive alias hung ``dumps()``, a control character split the message.
"""

from __future__ import annotations

import re
import time
import tracemalloc
from pathlib import Path

import pytest
from torch import nn

from erase_tune import Cut, ErasePlan, PlanError

MAX_SECONDS = 1.0
MAX_PEAK_BYTES = 16 << 20


def _laughs(levels: int = 9) -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "provenance:\n" + "\n".join("  " + line for line in lines)


CASES = {
    "run of 10^11 blocks": ("cuts: [layers.0:100000000000]", r"cuts\[0\].module: run 'layers.0:100000000000' has a bound of more than 9 digits"),
    "run over the length limit": ("cuts: [layers.0:100001]", r"has 100001 blocks, more than the limit of 100000"),
    "long runs that overlap": (
        "cuts: [" + ", ".join(f"l{i}.0:20000" for i in range(1000)) + ", l999.19999:20000]",
        r"cuts\[1000\].module: 'l999.19999:20000' overlaps cuts\[999\].module 'l999.0:20000'",
    ),
    "too many cuts": ("cuts: [" + ", ".join(f"m{i}" for i in range(1025)) + "]", r"cuts: 1025 entries, more than the limit of 1024"),
    "a trillion streams": ("num_streams: 1000000000000", r"num_streams: 1000000000000 must be an integer in 0..64"),
    "a huge stream id": ("num_streams: 2\ncuts: [{module: a, stream: 99999999999999999999999}]", r"cuts\[0\].stream: .* must be an integer in 0..64"),
    "deep nesting": ("cuts: " + "[" * 500 + "]" * 500, r"nested"),
    "a 5000-digit integer": ("num_streams: " + "9" * 5000, r"not valid YAML: a value cannot be read"),
    "a 4000-digit aux weight": ("cuts: [{module: a, aux_weight: " + "9" * 4000 + "}]", r"cuts\[0\].aux_weight: <an integer of \d+ bits> must be a finite number"),
    "mixed-type keys": ("{1: a, b: c}", r"the top level has the key 1: keys must be strings"),
    "a nested non-string key": ("cuts: [{module: a, [1]: 2}]", r"not valid YAML|keys must be strings"),
    "a recursive alias in provenance": ("provenance: &a [*a]", r"provenance(\[0\])+ is nested more than 32 levels deep"),
    "a recursive mapping alias": ("provenance: &a {x: *a}", r"nested more than 32 levels deep"),
    "a billion laughs": (_laughs(), r"more than 100000 values"),
    "a control character in a value": ('dispatch: "fast\\nslow\\u001b[2J"', r"dispatch: 'fast\\nslow\\x1b\[2J' is not one of"),
    "a control character in a key": ('"bo\\u0007gus": 1', r"'bo\\x07gus': unknown field"),
    "a control character in a module": ('cuts: ["a\\nb"]', r"cuts\[0\].module: 'a\\nb' is neither"),
    "a 100 kB module name": ("cuts: [" + "a" * 100_000 + "!]", r"cuts\[0\].module: 'aaaa.*… is neither"),
    "a file over 1 MiB": ("#" * (1 << 20) + "\n", r"plan file is larger than 1024 KiB"),
    "provenance that is not plain data": ("provenance: {a: {b: {c: 1}}}", r"provenance.a.b: dict is not allowed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_plan_files(tmp_path: Path, case: str):
    text, pattern = CASES[case]
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    started = time.perf_counter()
    with pytest.raises(PlanError) as e:
        ErasePlan.load(path)
    elapsed = time.perf_counter() - started
    tracemalloc.start()  # a second, traced load: tracing slows YAML's scanner several-fold
    try:
        with pytest.raises(PlanError):
            ErasePlan.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "\n" not in message and len(message) < 400, message
    assert message.isprintable(), message
    assert re.search(pattern, message), message
    assert elapsed < MAX_SECONDS, f"{case}: {elapsed:.2f} s"
    assert peak < MAX_PEAK_BYTES, f"{case}: peak {peak / 2**20:.1f} MiB"


def test_special_files_are_read_bounded():
    started = time.perf_counter()
    with pytest.raises(PlanError, match="larger than 1024 KiB"):
        ErasePlan.load("/dev/zero")
    assert time.perf_counter() - started < MAX_SECONDS
    with pytest.raises(PlanError, match="cannot read plan file"):
        ErasePlan.load("/")


def test_not_utf8(tmp_path: Path):
    path = tmp_path / "plan.yaml"
    path.write_bytes(b"dispatch: \xff\xfe")
    with pytest.raises(PlanError, match=r"not UTF-8 text \(byte 10\)"):
        ErasePlan.load(path)


def test_long_disjoint_runs_are_checked_fast_and_then_against_the_model():
    cuts = tuple(Cut(module=f"layers.{i * 100_000}:{(i + 1) * 100_000}") for i in range(1024))
    started = time.perf_counter()
    plan = ErasePlan(cuts=cuts)
    assert time.perf_counter() - started < MAX_SECONDS
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(1, 1) for _ in range(3))
    with pytest.raises(PlanError, match=r"cuts\[0\].module: run 'layers.0:100000' ends past 'layers', which has 3 blocks"):
        plan.check_model(model)


def test_dumps_of_a_loaded_plan_is_bounded():
    plan = ErasePlan.loads("provenance: {study: s, args: {batch: 2048}, tags: [a, b]}")
    assert ErasePlan.loads(plan.dumps()) == plan
