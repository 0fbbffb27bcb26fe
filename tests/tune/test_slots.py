"""How many trial slots a job starts, and what their start-up costs it.

A job starts no more slots than it has trials (a 4-trial job on 16 CPUs started 16 trial
workers), and none before it asks for one. The start summary's "once per job: worker start" is
the job's wall time spent starting workers: slots that start side by side count once (on 16 CPU
slots it read 183.8 s, the sum of the slots' start-ups, for a command of under 43 s). A CPU slot
whose trial failed in Python runs the next trial in the same worker; one whose worker died is
replaced, and on CUDA every failure replaces the slot."""

from __future__ import annotations

import os

import pytest
import ray

from erase_tune.errors import EraseTuneError
from erase_tune.tune.execute.executor import RayExecutor, covered_s
from erase_tune.tune.execute.task import TrialSpec, fit_after, run_spec
from erase_tune.tune.run.check import check_space_file
from tests.tune.faulty import TINY_CTR, write_space

FAULTY = "tests.tune.faulty:workload"
BUDGET = {"warmup_steps": 5, "windows": 1, "max_windows": 1, "window_steps": 2, "quality_steps": 5}


def test_worker_start_counts_slots_that_start_side_by_side_once():
    assert covered_s([]) == 0.0
    assert covered_s([(0.0, 11.0)] * 16) == 11.0  # 16 slots started together: 11 s of the job, not 176
    assert covered_s([(0.0, 10.0), (5.0, 12.0), (30.0, 34.0)]) == 16.0  # a replacement later adds its own
    assert covered_s([(5.0, 12.0), (0.0, 20.0)]) == 20.0  # one inside another


def test_no_more_slots_than_trials_and_none_started_before_asked(ray_cluster):
    groups = len(ray.util.placement_group_table())  # removed ones stay listed
    cluster, one, asked = (RayExecutor(workload="ctr", device="cpu", slots=slots) for slots in (None, None, 2))
    try:
        one.cap_slots(1)
        asked.cap_slots(1)
        assert (cluster.slots, one.slots, asked.slots) == (2, 1, 1)  # the shared cluster has 2 CPUs
        assert "1 trial slot(s) of 1 CPU(s)" in one.describe
        assert len(ray.util.placement_group_table()) == groups  # no worker until a slot is asked for
    finally:
        for executor in (cluster, one, asked):
            executor.close()


def test_check_estimates_with_no_more_slots_than_trials(tmp_path):
    space = write_space(tmp_path / "tiny.yaml", trials=3)
    assert check_space_file(space, trials=1, slots=2).slots == 1  # (tests/tune/test_check_space.py: 3 and 1)
    with pytest.raises(EraseTuneError, match=r"--slots: 2048 must be in 1\.\.1024"):  # start's bound, not 4096
        check_space_file(space, slots=2048)


def test_a_worker_says_whether_it_stays_fit_after_a_failure(tmp_path):
    spec = TrialSpec(trial_number=0, workload=FAULTY, workload_args={"mode": "raise", **TINY_CTR}, plan={},
                     budget=BUDGET, device="cpu")
    failed = run_spec(spec)
    assert failed.failure is not None and "planted failure" in failed.failure.reason, failed.failure
    assert failed.failure.kind == "trial" and failed.worker.reusable
    assert failed.worker.pid == os.getpid()
    assert fit_after("cpu") and not fit_after("cuda")  # a failed capture's RNG state cannot be checked
    assert not fit_after("cpu", process_group=object())  # a rank of a failed data-parallel trial
    gone = run_spec(TrialSpec(trial_number=1, workload="no_such_package_xyz:w", workload_args={}, plan={},
                              budget={}, device="cpu"))
    assert gone.failure is not None and gone.failure.kind == "infra" and not gone.worker.reusable


def test_a_cpu_slot_keeps_its_worker_after_a_trial_failure_and_replaces_a_dead_one(ray_cluster, tmp_path):
    tickets = tmp_path / "tickets"
    tickets.mkdir()
    args = {"mode": "nan,raise,crash", "tickets": str(tickets), **TINY_CTR}
    executor = RayExecutor(workload=FAULTY, slots=1, device="cpu")
    try:
        executor.wait_ready()
        slots = []
        for number in range(3):
            slots.append(executor._groups[0])
            executor.submit(TrialSpec(trial_number=number, workload=FAULTY, workload_args=args, plan={},
                                      budget=BUDGET))
            ((_, outcome),) = executor.wait(timeout=120)
            assert outcome.failure is not None, outcome
            assert (outcome.failure.kind, outcome.worker.reusable) == (("infra", False) if number == 2 else
                                                                        ("trial", True)), outcome.failure
        pids = {f.name.split("-", 1)[1]: int(f.read_text()) for f in tickets.iterdir()}
        assert sorted(pids) == ["crash", "nan", "raise"]  # each trial got as far as the workload's data
        assert pids["nan"] == pids["raise"] == pids["crash"]  # one worker ran all three
        assert slots[0] is slots[1] is slots[2] and executor._groups[0] is not slots[2]  # replaced after the crash
        assert executor.worker_start_s > 0
    finally:
        executor.close()


def test_a_trial_cancelled_after_it_finished_keeps_its_result_and_its_slot_is_replaced(ray_cluster):
    """The job may cancel a trial (its time-out) just as it finishes: the result stands, and the
    slot, whose workers the cancel killed, is a fresh one for the next trial."""
    executor = RayExecutor(workload=FAULTY, slots=1, device="cpu")
    try:
        executor.wait_ready()
        first = executor._groups[0]
        handle = executor.submit(TrialSpec(trial_number=0, workload=FAULTY, workload_args={"mode": "ok", **TINY_CTR},
                                           plan={}, budget=BUDGET))
        assert ray.wait([handle.ref], timeout=120)[0]  # finished, not yet collected
        executor.cancel(handle, "timed out after 1s")
        ((_, outcome),) = executor.wait(timeout=30)
        assert outcome.complete, outcome.failure
        assert executor._groups[0] is not first
    finally:
        executor.close()
