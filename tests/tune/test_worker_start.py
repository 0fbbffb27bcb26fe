"""The start summary's "once per job: worker start" is the job's wall time spent starting trial
workers: slots that start side by side count once (on 16 CPU slots it read 183.8 s, the sum of
the slots' start-ups, for a command of under 43 s)."""

from __future__ import annotations

from erase_tune.tune.execute.executor import covered_s


def test_worker_start_counts_slots_that_start_side_by_side_once():
    assert covered_s([]) == 0.0
    assert covered_s([(0.0, 11.0)] * 16) == 11.0  # 16 slots started together: 11 s of the job, not 176
    assert covered_s([(0.0, 10.0), (5.0, 12.0), (30.0, 34.0)]) == 16.0  # a replacement later adds its own
    assert covered_s([(5.0, 12.0), (0.0, 20.0)]) == 20.0  # one inside another
