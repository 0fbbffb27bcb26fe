"""The benchmark case ddp_table1 (recorded with scripts/ddp_table1.py) as a CPU smoke test: two
gloo ranks, tiny CTR args, a tiny budget.

The graph variants need CUDA and are skipped on the CPU; the two eager ERASE variants (FUP
off and on) must run in one process group and report finite ratios. The figures themselves
mean nothing here (tiny model, two shared cores); the GPU run is the benchmark suite c.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from erase_tune.tune.search.space import SearchSpace
from tests.tune.faulty import TINY_CTR

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90  # a hung collective fails the test instead of blocking the run


def _script():
    from erase_tune.benchmarks import ddp_table1

    return ddp_table1


def test_defaults_are_the_ctr_space():
    space = SearchSpace.load(ROOT / "search_spaces" / "ctr.yaml")
    t1 = _script()
    assert {**t1.CTR_ARGS, "train_batches": space.workload.args["train_batches"]} == space.workload.args
    assert {k: getattr(space.budget.per_trial, k) for k in t1.CTR_BUDGET} == t1.CTR_BUDGET


def test_ddp_table1_runs_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "ddp_table1.json"
    args = [a for k, v in TINY_CTR.items() if k != "train_batches" for a in ("--arg", f"{k}={v}")]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "erase_tune.benchmarks", "ddp_table1", "--out", str(tmp_path),
                           "--device", "cpu", "--ranks", "2",
                           "--warmup-steps", "5", "--windows", "1", "--window-steps", "2", "--quality-steps", "2", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["case"] == "ddp_table1" and record["complete"] and record["provenance"]["date_utc"]
    doc = record["result"]
    assert doc["ranks"] == 2 and doc["provenance"]["ranks"] == 2 and doc["complete"]
    assert doc["provenance"]["backend"] == "gloo" and doc["provenance"]["date_utc"]
    # One pass: ranks x a trial's most steps (--windows 1 is the least it times; max_windows stays 20).
    assert doc["args"]["train_batches"] == 2 * (5 + 20 * 2 + 2)
    assert [r["variant"] for r in doc["variants"]] == ["a", "b"]
    assert [s["variant"] for s in doc["skipped"]] == ["c", "d", "e", "f"] and not doc["failed"]
    for r in doc["variants"]:
        for key in ("qps_ratio_vs_eager", "ne_gap", "detach_only_ratio_vs_eager"):
            assert math.isfinite(r[key]), (r["variant"], key, r[key])
        assert r["qps_ratio_vs_graph"] is None  # no graph baseline on the CPU
        assert r["trial"]["provenance"]["ranks"] == 2
    a, b = doc["variants"]
    assert a["plan_dict"]["find_unused_parameters"] is False and b["plan_dict"]["find_unused_parameters"] is True
    assert b["baseline_ne_cached"] and b["ne_baseline"] == a["ne_baseline"]
    assert "| a | ERASE blocking, FUP off |" in proc.stdout and proc.stdout.rstrip().endswith(doc["table"].splitlines()[-1])
