"""Data-parallel ERASE on the CPU: two gloo ranks, float64.

Two processes (tests/runtime/ddp_worker.py) run every case once, in one process group; the
tests here compare what they saved. After two steps on equal shards of each global batch,
every rank's gradients (model and aux heads) and weights are bit-identical across ranks and
equal to a single-process engine trained on the whole batches: the gradients were averaged,
and averaged exactly once (twice, or not at all, would not match), in every dispatch mode,
with find_unused_parameters on and off.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from erase_tune import EraseEngine
from tests.runtime import ddp_worker as w
from tests.runtime.models import Toy, loss_fn

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
TIMEOUT_S = 90  # a hang (collectives out of order) fails the test instead of blocking the run


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    return w.run_ranks(WORLD, out, timeout_s=TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})


def reference(plan, batches) -> dict:
    """A single-process engine trained on ``batches`` (whole global batches, or one rank's shards)."""
    torch.manual_seed(0)
    engine = EraseEngine(Toy().double(), plan, loss_fn=loss_fn, optimizer=w.sgd, example=batches[0])
    losses = [float(engine.step(*b)) for b in batches]
    out = w.snapshot(engine, losses)
    engine.close()
    return out


def assert_same(got: dict, ref: dict, what: str) -> None:
    assert got["grads"].keys() == ref["grads"].keys()
    for kind in ("grads", "params"):
        for name, g in ref[kind].items():
            assert g is not None and got[kind][name] is not None, (what, kind, name)
            torch.testing.assert_close(got[kind][name], g, rtol=1e-11, atol=1e-13, msg=f"{what}: {kind} {name}")


def assert_bit_identical(a: dict, b: dict, what: str) -> None:
    for kind in ("grads", "params"):
        for name, g in a[kind].items():
            assert torch.equal(g, b[kind][name]), (what, kind, name)


@pytest.mark.parametrize("case", list(w.plans()))
def test_gradients_identical_across_ranks_and_equal_the_global_batch_reference(ranks, case):
    plan = w.plans()[case]
    ref = reference(plan, [w.batch(step) for step in range(w.STEPS)])
    r0, r1 = (r["cases"][case] for r in ranks)
    assert_bit_identical(r0, r1, case)
    assert_same(r0, ref, case)
    # each rank's loss is its own shard's; their mean is the global batch's mean loss
    for step in range(w.STEPS):
        assert (r0["losses"][step] + r1["losses"][step]) / 2 == pytest.approx(ref["losses"][step], rel=1e-12)


def test_without_a_process_group_each_rank_trains_alone(ranks):
    """torch.distributed is initialised, but no process_group was passed: nothing is reduced."""
    plan = w.plans()["blocking-fup-off"]
    for rank, r in enumerate(ranks):
        local = reference(plan, [w.batch(step, rank) for step in range(w.STEPS)])
        assert_same(r["no_group"], local, f"rank {rank} alone")
    assert not torch.equal(ranks[0]["no_group"]["grads"]["over.weight"], ranks[1]["no_group"]["grads"]["over.weight"])


def test_collectives_issued_in_completion_order_mix_up_the_sums(ranks):
    """The failure the order rule prevents: rank 0 reduces towers.0 then towers.2, rank 1 the
    reverse (as their backwards finished); same sizes, so nothing hangs, the sums are wrong."""
    for r in ranks:
        assert r["mixed_order"] == {"towers.0": False, "towers.2": False}


def test_plan_order_holds_when_backwards_finish_in_a_different_order_on_each_rank(ranks):
    orders = [r["completion_order"]["completion_order"] for r in ranks]
    assert orders[0][:3] != orders[1][:3], orders  # the backwards did finish in different orders
    plan = w.ErasePlan(cuts=w.CUTS, placements=w.PLACEMENTS, num_streams=2, dispatch="threaded")
    ref = reference(plan, [w.batch(step) for step in range(w.STEPS)])
    r0, r1 = (r["completion_order"] for r in ranks)
    assert_bit_identical(r0, r1, "completion order")
    assert_same(r0, ref, "completion order")


def test_a_ddp_wrapped_model_and_sparse_gradients_are_refused(ranks):
    for r in ranks:
        msg = r["refusals"]
        assert "not DistributedDataParallel" in msg["ddp"] and "process_group=" in msg["ddp"] and "\n" not in msg["ddp"]
        assert "sparse=True" in msg["sparse"] and "'emb'" in msg["sparse"] and "\n" not in msg["sparse"]


def test_a_cut_parameter_used_outside_its_cut_is_caught_when_reduced_early(ranks):
    """Reduced right after the cut's backward, it would miss the main backward's share."""
    for r in ranks:
        msg = r["refusals"]["shared-fup-False"]
        assert "towers.0.2.bias got a gradient after its cut's reduction" in msg and "find_unused_parameters: true" in msg
        assert r["refusals"]["shared-fup-True"] == "ok"



def test_train_ctr_example_under_torchrun(tmp_path, capsys):
    plan = w.ErasePlan(cuts=(w.Cut(module="subarchs.0", stream=1), w.Cut(module="subarchs.3", stream=2)),
                       placements=(w.Placement(module="subarchs.1", stream=1),), num_streams=2, dispatch="threaded")
    plan.save(tmp_path / "plan.yaml")
    args = {"batch": 64, "width": 16, "depth": 2, "emb_dim": 8, "num_tables": 4, "rows": 100, "sub_out": 8,
            "train_batches": 8, "eval_batches": 4}
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "examples" / "train_ctr.py")
    script_args = ["--plan", str(tmp_path / "plan.yaml"), "--steps", "5", "--device", "cpu",
                   *[f"--arg={k}={v}" for k, v in args.items()]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD), script, "--ddp",
           *script_args]
    done = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "data parallel over 2 ranks" in done.stdout
    assert done.stdout.count("held-out NE") == 1  # rank 0 only
    # two ranks on half batches train like one process on the whole batches (up to fp32 round-off)
    spec = importlib.util.spec_from_file_location("train_ctr", script)
    train_ctr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_ctr)
    capsys.readouterr()
    assert train_ctr.main(script_args) == 0  # in this process: no second interpreter to start
    alone = capsys.readouterr().out
    ne = [re.search(r"held-out NE ([0-9.]+) -> ([0-9.]+)", out).groups() for out in (done.stdout, alone)]
    assert ne[0][0] == ne[1][0]  # same initial weights
    assert float(ne[0][1]) == pytest.approx(float(ne[1][1]), abs=2e-4)
