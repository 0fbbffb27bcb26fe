"""Cross-stream overlap of GPU kernels, read from a torch.profiler Chrome trace.

ERASE's early backward is meant to run a cut's backward on a side stream while the main
stream runs the forward of what follows. This module measures how much that happens:

    overlap_fraction = |side-stream busy time ∩ main-stream busy time| / |side-stream busy time|

where "busy time" is the union of the stream's kernel intervals (so nested or back-to-back
kernels are not double-counted). 1.0 means every side-stream kernel ran under main-stream
work; 0.0 means the side stream only ran while the main stream was idle.

Read these numbers with care (docs/design.md, "Lessons"): under torch.profiler, kernels inside
CUDA graph replays showed zero cross-stream overlap and ~2x longer steps, while eager
threaded mode showed 13%. The profiler (CUPTI) can perturb graph concurrency, so judge the
worth of overlap by the timing ablation ("detach only" twin vs early launch), and use the
trace to explain, not to rank.

Trace format (what ``torch.profiler.profile(...).export_chrome_trace(path)`` writes): a JSON
object with ``traceEvents``; a GPU kernel is ``{"ph": "X", "cat": "kernel", "name": ...,
"ts": µs, "dur": µs, "pid": device, "tid": stream, "args": {"device": d, "stream": s, ...}}``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from erase_tune.errors import EraseTuneError, one_line

__all__ = [
    "KernelInterval",
    "OverlapReport",
    "kernel_intervals_from_trace",
    "overlap_report",
    "profile_steps",
    "merge_intervals",
]

KERNEL_CATEGORIES = ("kernel",)
"""Trace categories counted by default. Copies (``gpu_memcpy``) and fills (``gpu_memset``)
occupy copy engines rather than SMs; pass them explicitly to count them too."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelInterval:
    """One GPU activity on one stream, in trace microseconds."""

    stream: int
    start_us: float
    end_us: float
    name: str = ""
    device: int = 0

    def __post_init__(self) -> None:
        if not self.end_us >= self.start_us:
            raise ValueError(f"kernel {self.name!r}: end {self.end_us} is before start {self.start_us}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlapReport:
    """How much side-stream kernel time ran while the main stream was also busy."""

    main_stream: int | None
    """The stream treated as main (``None`` when the trace has no kernels)."""
    side_streams: tuple[int, ...]
    """Every other stream that ran kernels, ascending."""
    side_busy_us: float
    """Union of all side-stream kernel intervals, µs."""
    main_busy_us: float
    """Union of main-stream kernel intervals, µs."""
    overlapped_us: float
    """Time during which a side-stream kernel and a main-stream kernel both ran, µs."""
    overlap_fraction: float
    """``overlapped_us / side_busy_us``; 0.0 when there is no side-stream work."""
    span_us: float
    """First kernel start to last kernel end, µs: the window the figures above lie in."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {**dataclasses.asdict(self), "side_streams": list(self.side_streams)}


def kernel_intervals_from_trace(
    trace: Mapping[str, Any] | Sequence[Mapping[str, Any]] | str | os.PathLike[str],
    *,
    categories: Iterable[str] = KERNEL_CATEGORIES,
    device: int | None = None,
) -> list[KernelInterval]:
    """GPU activity intervals from a Chrome trace (a path, ``.json`` or ``.json.gz``, or parsed JSON).

    Categories match case-insensitively (some Kineto versions write ``Kernel``). A matching
    event without a usable ``ts``/``dur``/stream raises, because silently dropping kernels
    would understate busy time. ``device`` keeps only that GPU's activity (a trace of a
    multi-GPU process holds every device's kernels, and stream ids are per device).
    """
    if isinstance(trace, (str, os.PathLike)):
        trace = _load_trace(Path(trace))
    events = trace.get("traceEvents", []) if isinstance(trace, Mapping) else trace
    wanted = {c.lower() for c in categories}
    intervals = []
    for event in events:
        if not isinstance(event, Mapping) or str(event.get("cat", "")).lower() not in wanted:
            continue
        if event.get("ph", "X") != "X":  # flow arrows and instants carry no duration
            continue
        args = event.get("args") or {}
        try:
            start = float(event["ts"])
            duration = float(event["dur"])
            # Kineto writes the stream in args.stream and again as the tid; older traces may lack args.
            stream = int(args["stream"] if "stream" in args else event["tid"])
            event_device = int(args.get("device", event.get("pid", 0)))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"trace event {event.get('name', '?')!r} lacks a usable ts/dur/stream: {err}") from None
        if device is not None and event_device != device:
            continue
        intervals.append(
            KernelInterval(stream=stream, start_us=start, end_us=start + duration, name=str(event.get("name", "")), device=event_device)
        )
    return intervals


def merge_intervals(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of ``(start, end)`` spans as sorted, disjoint spans (touching spans are joined)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_report(intervals: Sequence[KernelInterval], main_stream: int | None = None) -> OverlapReport:
    """Overlap of side-stream kernels with main-stream kernels on one device.

    ``main_stream`` defaults to the stream of the earliest kernel (the smallest id on a tie):
    a training step starts on its main stream, while a side stream can be the busiest one
    (on an H200, the six CTR subarchs on side streams outweigh the remainder at batch 32768).
    Every other stream counts as a side stream; side streams are merged into one union, so
    two side streams overlapping each other are not counted twice.
    """
    devices = {k.device for k in intervals}
    if len(devices) > 1:
        raise ValueError(f"kernels from several devices {sorted(devices)}: filter the intervals to one device first")
    by_stream: dict[int, list[tuple[float, float]]] = {}
    for k in intervals:
        by_stream.setdefault(k.stream, []).append((k.start_us, k.end_us))
    merged = {stream: merge_intervals(spans) for stream, spans in by_stream.items()}
    if main_stream is None and merged:
        main_stream = min(merged, key=lambda s: (merged[s][0][0], s))
    main = merged.get(main_stream, []) if main_stream is not None else []
    side = merge_intervals(span for stream, spans in merged.items() if stream != main_stream for span in spans)
    side_busy = _length(side)
    overlapped = _intersection_length(main, side)
    return OverlapReport(
        main_stream=main_stream,
        side_streams=tuple(sorted(s for s in merged if s != main_stream)),
        side_busy_us=side_busy,
        main_busy_us=_length(main),
        overlapped_us=overlapped,
        overlap_fraction=overlapped / side_busy if side_busy > 0 else 0.0,
        span_us=(max(k.end_us for k in intervals) - min(k.start_us for k in intervals)) if intervals else 0.0,
    )


def profile_steps(
    step: Callable[[int], Any],
    *,
    steps: int,
    start_step: int,
    trace_path: str | os.PathLike[str],
    main_stream: int | None = None,
) -> OverlapReport:
    """Run ``steps`` training steps under torch.profiler, write the trace, report the overlap.

    Steps get global indices ``start_step .. start_step + steps - 1``; warm the step up
    beforehand (the first profiled steps otherwise show allocator and autotuning noise).
    CUDA activity is recorded when CUDA is available; on a CPU-only machine the trace holds
    no kernels and the report is all zeros. The profiler perturbs what it measures (see the
    module docstring): do not time steps from this run.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: {steps!r} must be an integer >= 1")
    activities = [torch.profiler.ProfilerActivity.CPU]
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        # Work queued before the profiler starts would show up as unexplained kernels.
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for k in range(steps):
            step(start_step + k)
        if use_cuda:
            # Kernels still running when the profiler stops are cut from the trace.
            torch.cuda.synchronize()
    path = os.fspath(trace_path)  # export_chrome_trace calls path.endswith, so it needs a str
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        prof.export_chrome_trace(path)
        intervals = kernel_intervals_from_trace(path)
    except (OSError, ValueError) as e:  # the profiler says it failed on stderr and goes on: a full disk
        why = e.strerror if isinstance(e, OSError) and e.strerror else one_line(e, 100)
        raise EraseTuneError(f"cannot write the trace {one_line(path, 300)} ({why}; the profiler could not write "
                             "it whole: a full disk?)") from None
    return overlap_report(intervals, main_stream=main_stream)


def _load_trace(path: Path) -> Any:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _length(spans: Sequence[tuple[float, float]]) -> float:
    return float(sum(end - start for start, end in spans))


def _intersection_length(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint span lists (two-pointer sweep)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        # Advance whichever span ends first; the other may still meet the next one.
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
