"""DistributedModelParallel with its default wrapper (the dense part in DistributedDataParallel)
trains under a plan: the engine stands the wrapper down and averages the dense gradients itself,
around the early backward passes. On the CPU over gloo, at one rank and at two."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchrec")

import torch

from erase_tune import Cut, EraseEngine, ErasePlan
from tests.torchrec.models import batch, dlrm, dmp, logits_loss, one_rank_group, sgd
from tests.torchrec.test_models import flat_head

ROOT = Path(__file__).resolve().parents[2]


def test_at_one_rank_a_blocking_cut_trains_exactly_as_without_the_wrapper():
    """The same model, plan, heads and batches under DMP with its DDP wrapper and without it:
    bitwise the same parameters after three steps; the wrapper is its own again afterwards."""
    dense, kjt, labels = batch()
    with one_rank_group():
        engines, models = {}, {}
        for wrap in (True, False):
            models[wrap] = model = dmp(dlrm(device="meta"), wrap_dense=wrap)
            inner = "_dmp_wrapped_module.module." if wrap else "_dmp_wrapped_module."
            plan = ErasePlan(cuts=(Cut(module=inner + "dense_arch"),), dispatch="blocking")
            engines[wrap] = EraseEngine(model, plan, loss_fn=logits_loss, optimizer=sgd,
                                        example=((dense, kjt), labels), make_head=flat_head)
        (wrapped_head,), (bare_head,) = engines[True].heads.values(), engines[False].heads.values()
        wrapped_head.load_state_dict(bare_head.state_dict())
        for wrap in (True, False):
            for s in range(3):
                engines[wrap].step(*_split(batch(seed=s)))
            engines[wrap].close()
        a, b = dict(models[True].named_parameters()), dict(models[False].named_parameters())
        assert a.keys() == b.keys() and len(a) == 11
        for name in a:
            assert torch.equal(a[name], b[name]), name
        assert "forward" not in models[True]._dmp_wrapped_module.__dict__


def _split(b):
    dense, kjt, labels = b
    return (dense, kjt), labels


def test_a_process_group_beside_the_wrapper_is_one_line():
    dense, kjt, labels = batch()
    with one_rank_group():
        model = dmp(dlrm(device="meta"), wrap_dense=True)
        plan = ErasePlan(cuts=(Cut(module="_dmp_wrapped_module.module.dense_arch"),), dispatch="blocking")
        with pytest.raises(Exception) as e:
            EraseEngine(model, plan, loss_fn=logits_loss, optimizer=sgd, example=((dense, kjt), labels),
                        make_head=flat_head, process_group=torch.distributed.GroupMember.WORLD)
        message = str(e.value)
        assert message.startswith("module '_dmp_wrapped_module' is wrapped in DistributedDataParallel") and \
            "leave process_group= out" in message and "\n" not in message


def test_at_two_ranks_the_engine_averages_what_ddp_would_have(tmp_path):
    """Two gloo ranks, tables sharded over them, each rank on its own batches: under a placement
    (no gradient changed) the engine's training equals DMP's own to float32 rounding; under a
    blocking cut it equals, bit for bit, the cut on DMP without its wrapper with the gradients
    averaged by hand, and the dense tower trains and stays the same on both ranks."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.torchrec.dmp_worker", str(r), "2", str(tmp_path / "init"),
                               str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    deadline = time.monotonic() + 240
    logs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for res in ranks:
        assert res["placement_restored"] and res["cut_restored"]
        for name, value in res["plain"].items():
            torch.testing.assert_close(res["placement"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    dense = [n for n in ranks[0]["cut"] if n.startswith("dense_arch.")]
    assert dense
    for res in ranks:  # the cut, exactly as its gradients averaged by hand train it
        assert res["cut"].keys() == res["cut_reference"].keys()
        for name, value in res["cut_reference"].items():
            assert torch.equal(res["cut"][name], value), name
    for name in dense:
        assert torch.equal(ranks[0]["cut"][name], ranks[1]["cut"][name]), name  # averaged: one dense tower
        assert not torch.equal(ranks[0]["cut"][name], ranks[0]["init"][name]), name  # and it trained
    # The dense parameters are the same on both ranks after DMP's own training too (a sanity check
    # of the reference: DDP averaged them), and the two ranks' tables are their own shards.
    for name in dense:
        assert torch.equal(ranks[0]["plain"][name], ranks[1]["plain"][name]), name
