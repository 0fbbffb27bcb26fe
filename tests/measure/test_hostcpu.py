"""The host-CPU measurement: what a variant's own host work costs, device waits left out."""

from __future__ import annotations

import time

import pytest
import torch

from erase_tune.measure.hostcpu import blocking_sync, host_cpu_interleaved, host_tax


def _work(n: int):
    """Host work in the calling thread only (a torch op here could leave OpenMP workers spinning)."""
    def step(i: int) -> None:
        sum(range(n * 1000))
    return step


def test_more_host_work_reads_as_a_tax_and_sleeping_does_not():
    calls: list[tuple[str, int]] = []

    def sleeper(i: int) -> None:  # wall time without CPU work
        calls.append(("sleep", i))
        time.sleep(0.002)
        sum(range(50_000))

    cpu = host_cpu_interleaved({"base": _work(50), "double": _work(100), "sleep": sleeper},
                               device=torch.device("cpu"), warmup_steps=1, windows=4, window_steps=5, start_step=7)
    assert set(cpu.per_window) == {"base", "double", "sleep"} and all(len(v) == 4 for v in cpu.per_window.values())
    med, lo, hi = host_tax(cpu, "double", "base")
    assert lo <= med <= hi and med > 0.5 * cpu.median_us("base")  # twice the work: about one more base
    slept, _, _ = host_tax(cpu, "sleep", "base")
    assert abs(slept) < 1000  # 2 ms asleep per step costs no CPU time (well under 1 ms of it)
    assert [i for _, i in calls] == list(range(7, 7 + 1 + 4 * 5))  # the step indices run on, as in timing
    assert cpu.waits_excluded and cpu.to_dict()["how"] == "cpu: no device waits; runners rotated from round to round"


def test_no_runners_is_refused():
    with pytest.raises(ValueError, match="runners"):
        host_cpu_interleaved({}, device=torch.device("cpu"), warmup_steps=0, windows=1, window_steps=1)


@pytest.mark.gpu
def test_blocking_sync_leaves_device_waits_out_of_the_cpu_time():
    device = torch.device("cuda")
    with blocking_sync(device) as (excluded, how):
        assert excluded, how
        torch.cuda._sleep(200_000_000)  # ~0.1 s on the device
        c0, w0 = time.process_time(), time.perf_counter()
        torch.cuda.synchronize(device)
        assert time.process_time() - c0 < 0.2 * (time.perf_counter() - w0)
    # Restored: the default (spin or auto) again costs CPU while waiting.
    torch.cuda._sleep(200_000_000)
    c0, w0 = time.process_time(), time.perf_counter()
    torch.cuda.synchronize(device)
    assert time.process_time() - c0 > 0.5 * (time.perf_counter() - w0)


def test_work_in_another_thread_counts_for_the_process_not_the_training_thread():
    import threading

    def helper_thread(i: int) -> None:  # the step's work done by another thread (as autograd's device thread does)
        t = threading.Thread(target=_work(100), args=(i,))
        t.start()
        t.join()

    cpu = host_cpu_interleaved({"here": _work(100), "there": helper_thread}, device=torch.device("cpu"),
                               warmup_steps=1, windows=4, window_steps=5)
    assert set(cpu.main_thread_per_window) == {"here", "there"}
    here, there = cpu.median_us("here", main_thread=True), cpu.median_us("there", main_thread=True)
    assert there < 0.5 * here  # the training thread only waited for the other one
    assert cpu.median_us("there") > 0.5 * cpu.median_us("here")  # the process did the work all the same
    moved, _, _ = host_tax(cpu, "there", "here", main_thread=True)
    assert moved < 0
