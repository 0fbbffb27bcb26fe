"""A confirmation or reference try that cannot get a slot stops at the limit it announced, not
at that limit once per retry (real local Ray): "stopped after 5m00s at most" was printed while
three tries on a cluster that had lost a node could wait five minutes each."""

from __future__ import annotations

import time

from erase_tune.tune.execute.executor import RayExecutor
from erase_tune.tune.execute.task import ConfirmSpec, ReferenceSpec, TrialSpec
from tests.loglines import erase_tune_lines
from tests.tune.faulty import TINY_CTR

FAULTY = "tests.tune.faulty:workload"
LIMIT_S = 3.0


def test_a_phase_with_no_free_slot_ends_at_the_limit_it_announced(ray_cluster):
    executor = RayExecutor(workload=FAULTY, slots=1, device="cpu")
    try:
        executor.wait_ready()
        # The only slot is taken by a trial that never ends: no try can get a slot.
        hung = executor.submit(TrialSpec(trial_number=0, workload=FAULTY, workload_args={"mode": "hang", **TINY_CTR},
                                         plan={}, budget={}))
        spec = ConfirmSpec(workload=FAULTY, workload_args=TINY_CTR, plans={}, budget={}, windows=2,
                           gain_over="eager", task="noise")
        with erase_tune_lines() as said:
            began = time.monotonic()
            outcome = executor.confirm(spec, timeout=LIMIT_S, attempts=3)
            took = time.monotonic() - began
        assert outcome.failure is not None and outcome.failure.reason == "no free trial slot for the confirmation"
        assert any("stopped after 3s at most" in line for line in said), said
        assert LIMIT_S <= took < 2 * LIMIT_S, f"announced {LIMIT_S:.0f}s, took {took:.1f}s"  # 3 tries: 9s before

        began = time.monotonic()
        ref = executor.reference(ReferenceSpec(workload=FAULTY, workload_args=TINY_CTR), timeout=LIMIT_S, attempts=3)
        took = time.monotonic() - began
        assert ref.failure is not None and ref.failure.reason == "no free trial slot for the try"
        assert LIMIT_S <= took < 2 * LIMIT_S, f"limit {LIMIT_S:.0f}s, took {took:.1f}s"
        executor.cancel(hung, "test over")
    finally:
        executor.close()


def test_a_phase_gets_the_slot_of_a_trial_that_finished_meanwhile(ray_cluster):
    """The job's one thread records nothing while a phase waits for a slot: a trial that ends then
    gives its slot to the phase, and its outcome still comes from ``wait`` afterwards. (A noise
    floor retried after its node was lost waited five minutes for the other slot, whose trial had
    ended seconds after the retry began, and the job failed.)"""
    executor = RayExecutor(workload=FAULTY, slots=1, device="cpu")
    try:
        executor.wait_ready()
        budget = {"warmup_steps": 5, "windows": 2, "max_windows": 2, "window_steps": 2}
        executor.submit(TrialSpec(trial_number=7, workload=FAULTY, workload_args={"mode": "ok", **TINY_CTR},
                                  plan={}, budget=budget))
        began = time.monotonic()
        ref = executor.reference(ReferenceSpec(workload=FAULTY, workload_args={"mode": "ok", **TINY_CTR}),
                                 timeout=120)
        assert ref.failure is None, ref.failure
        assert time.monotonic() - began < 60  # the slot came back when the trial ended, not at the limit
        done = executor.wait(timeout=0)
        assert [(h.spec.trial_number, o.complete) for h, o in done] == [(7, True)], [o.failure for _, o in done]
        assert executor.wait(timeout=0) == [] and not executor.running
    finally:
        executor.close()
