"""The job's one try of the whole-step-graph reference, through the real local Ray on the CPU:
the worker answers (None on the CPU: there is no graph reference there), a workload that fails
on the way is a failure of the try (not of the driver) and its slot is replaced; and a job on
CPU slots tries nothing (tests/tune/test_reference_gpu.py has the GPU side)."""

from __future__ import annotations

import os

import optuna

from erase_tune.tune.execute.executor import RayExecutor
from erase_tune.tune.search.study import Attr
from erase_tune.tune.execute.task import ReferenceSpec
from tests.tune.conftest import run_cli
from tests.tune.faulty import TINY_CTR, write_space

FAULTY = "tests.tune.faulty:workload"


def test_the_try_runs_on_a_worker(ray_cluster):
    executor = RayExecutor(workload=FAULTY, slots=1, device="cpu")
    try:
        executor.wait_ready()
        ok = executor.reference(ReferenceSpec(workload=FAULTY, workload_args={"mode": "ok", **TINY_CTR}), timeout=60)
        assert ok.error is None and ok.failure is None and ok.reason is None and ok.worker.pid is not None
        # The worker keeps this process's priority: Ray's default niceness 15 for its workers
        # would let any busy process on the host starve the step it times.
        assert os.getpriority(os.PRIO_PROCESS, ok.worker.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        first = executor._groups[0]
        assert first.state == "ready"  # a try that did not fail keeps its (warm) slot

        # A workload the worker cannot build (a bad argument only it sees) fails the try.
        bad = executor.reference(ReferenceSpec(workload=FAULTY, workload_args={"mode": "bogus", **TINY_CTR}),
                                 timeout=60)
        assert bad.failure is not None and bad.failure.kind == "trial" and "'bogus' is not one of" in bad.reason
        assert executor._groups[0] is not first  # the slot that ran it is replaced by a fresh one
    finally:
        executor.close()


def test_a_job_on_cpu_slots_tries_nothing(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'cpu.db'}"
    space = write_space(tmp_path / "cpu.yaml", trials=1)
    assert run_cli("start", "--space", space, "--study", "cpu", "--storage", url, "--slots", 1, "--no-confirm") == 0
    assert "cannot be captured" not in capsys.readouterr().err
    assert Attr.REFERENCE_ERROR not in optuna.load_study(study_name="cpu", storage=url).user_attrs
