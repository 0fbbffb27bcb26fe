"""The host's own work per step, apart from the time it spends waiting for the device.

On a host-bound model (the reference DLRM at batch 4096) a step's wall time moves by ±10–20%
from one 30-step window to the next, even for the same code, so a runtime's host tax of tens of
microseconds cannot be read off wall-clock ratios. What can be read is the process's CPU time:
the Python, the dispatcher, the launches, in every thread (the autograd engine's device threads
and the runtime's launcher included). It leaves out what the host does not spend working:
sleeping on the device. By default a CUDA host thread *spins* while it waits at a synchronising
call (``cudaStreamSynchronize``, a pageable copy, ``.item()``), which burns CPU time for every
microsecond the device is behind; :func:`blocking_sync` switches the device to
``cudaDeviceScheduleBlockingSync`` for the measurement (the thread sleeps at every wait), checks
on a device-side sleep that a wait really costs no CPU time, and restores the flags after.

:func:`host_cpu_interleaved` then runs the variants in the same alternating windows as
:func:`erase_tune.measure.time_interleaved` and reports each variant's process CPU time per step,
per window, and the training thread's own share of it (the rest is other threads': the
autograd engine's device threads, a launcher); :func:`host_tax` is the per-window median
difference of two variants in µs/step.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import statistics
import time
from collections.abc import Iterator, Mapping

import torch

from erase_tune.measure.timing import StepRunner, Steps, interleave

__all__ = ["HostCpu", "blocking_sync", "host_cpu_interleaved", "host_tax"]

_SCHEDULE_MASK = 0x07  # cudaDeviceScheduleAuto/Spin/Yield/BlockingSync
_BLOCKING_SYNC = 0x04
_KEPT = 0x18  # cudaDeviceMapHost | cudaDeviceLmemResizeToMax: what a set call may carry over


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostCpu:
    """Process CPU seconds per step of each variant, one value per window (interleaving round)."""

    per_window: dict[str, tuple[float, ...]]
    main_thread_per_window: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    """The calling (training) thread's own CPU seconds per step, per window: the rest of the
    process's time is other threads' (the autograd engine's device threads, a launcher)."""
    waits_excluded: bool
    """True when device waits cost no CPU time (a CPU run, or blocking sync checked on the device)."""
    how: str
    """How waits were treated, in words (for provenance)."""

    def series(self, name: str, *, main_thread: bool = False) -> tuple[float, ...]:
        """``name``'s seconds per step, window by window (the training thread's with ``main_thread``)."""
        return (self.main_thread_per_window if main_thread else self.per_window)[name]

    def median_us(self, name: str, *, main_thread: bool = False) -> float:
        return statistics.median(self.series(name, main_thread=main_thread)) * 1e6

    def to_dict(self) -> dict[str, object]:
        return {"per_window_s": {k: list(v) for k, v in self.per_window.items()},
                "main_thread_per_window_s": {k: list(v) for k, v in self.main_thread_per_window.items()},
                "waits_excluded": self.waits_excluded, "how": self.how}


def host_tax(cpu: HostCpu, name: str, over: str, *, main_thread: bool = False) -> tuple[float, float, float]:
    """(median, lo, hi) over windows of ``name``'s CPU µs/step minus ``over``'s in the same window
    (the training thread's alone with ``main_thread``)."""
    diffs = sorted((a - b) * 1e6 for a, b in zip(cpu.series(name, main_thread=main_thread),
                                                 cpu.series(over, main_thread=main_thread)))
    return statistics.median(diffs), diffs[0], diffs[-1]


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process already loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        paths = set()
    for path in sorted(paths) + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            lib = ctypes.CDLL(path)
            lib.cudaGetDeviceFlags  # noqa: B018 - the symbol must be there
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _wait_costs_cpu(device: torch.device) -> float:
    """CPU seconds per wall second while the host waits on a device-side sleep (~40 ms at 2 GHz)."""
    stream = torch.cuda.current_stream(device)
    torch.cuda._sleep(1_000)  # load the kernel once
    torch.cuda.synchronize(device)
    torch.cuda._sleep(80_000_000)
    c0, w0 = time.process_time(), time.perf_counter()
    stream.synchronize()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return cpu / wall if wall > 0 else 1.0


@contextlib.contextmanager
def blocking_sync(device: torch.device) -> Iterator[tuple[bool, str]]:
    """Within the block, the host sleeps instead of spinning while it waits for ``device``.
    Yields ``(waits_excluded, how)``; on a CPU device there is nothing to wait for."""
    device = torch.device(device)
    if device.type != "cuda":
        yield True, "cpu: no device waits"
        return
    lib = _cudart()
    if lib is None:
        yield False, "CUDA runtime library not found: waits spin and count as host CPU time"
        return
    with torch.cuda.device(device):
        torch.cuda.init()
        old = ctypes.c_uint(0)
        if lib.cudaGetDeviceFlags(ctypes.byref(old)) != 0:
            yield False, "cudaGetDeviceFlags failed: waits spin and count as host CPU time"
            return
        new = (old.value & _KEPT) | _BLOCKING_SYNC
        if lib.cudaSetDeviceFlags(ctypes.c_uint(new)) != 0:
            yield False, "cudaSetDeviceFlags(BlockingSync) refused: waits spin and count as host CPU time"
            return
        try:
            share = _wait_costs_cpu(device)
            ok = share < 0.2
            how = (f"cudaDeviceScheduleBlockingSync: a 40 ms device wait cost {share:.0%} CPU"
                   + ("" if ok else " (not excluded: read the CPU times as host work plus waits)"))
            yield ok, how
        finally:
            lib.cudaSetDeviceFlags(ctypes.c_uint((old.value & _KEPT) | (old.value & _SCHEDULE_MASK)))


def host_cpu_interleaved(runners: Mapping[str, StepRunner], *, device: torch.device, warmup_steps: int,
                         windows: int, window_steps: int, start_step: int = 0, order: str = "rotate") -> HostCpu:
    """Every runner's process CPU time per step, window by window, in the rounds of
    :func:`erase_tune.measure.time_interleaved` (which see for ``start_step`` and the step
    indices; ``order`` as in :func:`erase_tune.measure.timing.interleave`), under
    :func:`blocking_sync`. Each window ends with a device sync, so a window's CPU time holds all
    of its own steps' host work and none of the next variant's."""
    if not runners:
        raise ValueError("runners: need at least one runner to measure")
    device = torch.device(device)
    names = {id(r): n for n, r in runners.items()}
    if len(names) != len(runners):
        raise ValueError("runners: each runner once (the training thread's time is kept per runner)")
    thread: dict[str, list[float]] = {n: [] for n in runners}

    def window(step: StepRunner, first: int, count: int, device: torch.device) -> list[float]:
        """One sample: the window's process CPU seconds per step, its device work waited for
        (and, on the side, the training thread's own)."""
        c0, t0 = time.process_time(), time.thread_time()
        for k in range(count):
            step(first + k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        thread[names[id(step)]].append((time.thread_time() - t0) / count)
        return [(time.process_time() - c0) / count]

    with blocking_sync(device) as (excluded, how):
        out, _ = interleave(runners, window, device=device, windows=windows, order=order,
                            steps=Steps(warmup_steps=warmup_steps, window_steps=window_steps, start_step=start_step))
    return HostCpu(per_window={n: tuple(v) for n, v in out.items()},
                   main_thread_per_window={n: tuple(v) for n, v in thread.items()}, waits_excluded=excluded,
                   how=f"{how}; runners {'shuffled' if order == 'shuffle' else 'rotated'} from round to round")
