"""How many trial slots a job starts, and what their start-up costs it.

A job starts no more slots than it has trials (a 4-trial job on 16 CPUs started 16 trial
workers), and none before it asks for one. The start summary's "once per job: worker start" is
the job's wall time spent starting workers: slots that start side by side count once (on 16 CPU
slots it read 183.8 s, the sum of the slots' start-ups, for a command of under 43 s)."""

from __future__ import annotations

import ray

from erase_tune.tune.execute.executor import RayExecutor, covered_s
from erase_tune.tune.run.check import check_space_file
from tests.tune.faulty import write_space


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
