"""Tests for cross-stream overlap from profiler traces: synthetic traces, files, the profiler."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from erase_tune.measure import (
    KernelInterval,
    kernel_intervals_from_trace,
    merge_intervals,
    overlap_report,
    profile_steps,
)


def _kernel(stream, ts, dur, name="k", device=0, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": device, "stream": stream}}  # fmt: skip


def _trace(*events):
    cpu_op = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 500}
    flow = {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 3, "pid": 0, "tid": 7, "ts": 10}
    return {"traceEvents": [cpu_op, flow, *events]}


# Main stream 7 busy on [0, 100] and [150, 250]; side stream 13 busy on [50, 200]:
# overlap [50, 100] + [150, 200] = 100 of 150 side µs.
TWO_STREAMS = _trace(_kernel(7, 0, 100), _kernel(7, 150, 100), _kernel(13, 50, 150, name="side"))


def test_parses_kernels_only():
    intervals = kernel_intervals_from_trace(TWO_STREAMS)
    assert sorted((k.stream, k.start_us, k.end_us) for k in intervals) == [(7, 0, 100), (7, 150, 250), (13, 50, 200)]
    assert {k.name for k in intervals} == {"k", "side"}


def test_two_streams_known_overlap():
    r = overlap_report(kernel_intervals_from_trace(TWO_STREAMS))
    assert r.main_stream == 7  # its first kernel starts first
    assert r.side_streams == (13,)
    assert (r.main_busy_us, r.side_busy_us, r.overlapped_us) == (200, 150, 100)
    assert r.overlap_fraction == pytest.approx(100 / 150)
    assert r.span_us == 250


def test_explicit_main_stream_swaps_roles():
    r = overlap_report(kernel_intervals_from_trace(TWO_STREAMS), main_stream=13)
    assert (r.main_busy_us, r.side_busy_us, r.overlapped_us) == (150, 200, 100)
    assert r.overlap_fraction == pytest.approx(0.5)


def test_nested_and_adjacent_kernels_are_not_double_counted():
    trace = _trace(
        _kernel(7, 0, 100), _kernel(7, 20, 30),  # nested in the first
        _kernel(7, 100, 50),  # adjacent: main busy [0, 150]
        _kernel(13, 140, 20), _kernel(13, 160, 40), _kernel(13, 145, 5),  # side busy [140, 200]
        _kernel(21, 190, 20),  # second side stream, overlapping the first: side union [140, 210]
    )  # fmt: skip
    r = overlap_report(kernel_intervals_from_trace(trace), main_stream=7)
    assert r.main_busy_us == 150
    assert r.side_busy_us == 70
    assert r.overlapped_us == 10  # [140, 150]
    assert r.side_streams == (13, 21)


def test_one_long_kernel_meets_several_short_ones_on_the_other_stream():
    # Main [0, 100] and [110, 130]; side [10, 20], [30, 40], [90, 120]:
    # overlap 10 + 10 + 10 (at [90, 100]) + 10 (at [110, 120]) = 40 of 50 side µs.
    trace = _trace(_kernel(7, 0, 100), _kernel(7, 110, 20), _kernel(13, 10, 10), _kernel(13, 30, 10), _kernel(13, 90, 30))
    r = overlap_report(kernel_intervals_from_trace(trace), main_stream=7)
    assert (r.side_busy_us, r.overlapped_us) == (50, 40)
    swapped = overlap_report(kernel_intervals_from_trace(trace), main_stream=13)
    assert (swapped.side_busy_us, swapped.overlapped_us) == (120, 40)


def test_side_stream_only_during_main_idle_has_zero_overlap():
    trace = _trace(_kernel(7, 0, 100), _kernel(7, 300, 100), _kernel(13, 100, 200))
    r = overlap_report(kernel_intervals_from_trace(trace), main_stream=7)
    assert r.overlapped_us == 0
    assert r.overlap_fraction == 0.0


def test_no_side_stream_and_no_kernels():
    r = overlap_report(kernel_intervals_from_trace(_trace(_kernel(7, 0, 10), _kernel(7, 5, 10))))
    assert (r.main_stream, r.main_busy_us, r.side_busy_us, r.overlap_fraction) == (7, 15, 0.0, 0.0)
    empty = overlap_report([])
    assert empty.main_stream is None
    assert (empty.main_busy_us, empty.side_busy_us, empty.overlapped_us, empty.span_us) == (0, 0, 0, 0)


def test_main_stream_is_where_the_step_starts_not_the_busiest():
    # the step begins on stream 7; side stream 13 carries more work (detached pieces)
    trace = _trace(_kernel(7, 0, 20), _kernel(13, 10, 300), _kernel(7, 100, 20))
    r = overlap_report(kernel_intervals_from_trace(trace))
    assert r.main_stream == 7 and r.side_streams == (13,)
    assert r.overlapped_us == 30 and r.overlap_fraction == pytest.approx(30 / 300)


def test_tie_on_start_picks_smallest_stream():
    r = overlap_report(kernel_intervals_from_trace(_trace(_kernel(20, 0, 10), _kernel(9, 0, 10))))
    assert r.main_stream == 9
    assert r.overlap_fraction == 1.0


def test_categories_are_case_insensitive_and_selectable():
    trace = _trace(_kernel(7, 0, 10, cat="Kernel"), _kernel(13, 0, 10, cat="gpu_memcpy"))
    assert [k.stream for k in kernel_intervals_from_trace(trace)] == [7]
    both = kernel_intervals_from_trace(trace, categories=("kernel", "gpu_memcpy"))
    assert sorted(k.stream for k in both) == [7, 13]


def test_stream_falls_back_to_tid_and_string_timestamps_parse():
    event = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": "1000.5", "dur": "2.5"}
    [k] = kernel_intervals_from_trace({"traceEvents": [event]})
    assert (k.stream, k.start_us, k.end_us) == (7, 1000.5, 1003.0)


def test_malformed_kernel_event_raises():
    with pytest.raises(ValueError, match="bad"):
        kernel_intervals_from_trace({"traceEvents": [{"cat": "kernel", "name": "bad", "ts": 1.0, "args": {"stream": 7}}]})


def test_several_devices_need_a_filter():
    trace = _trace(_kernel(7, 0, 10, device=0), _kernel(7, 0, 10, device=1), _kernel(13, 5, 10, device=1))
    with pytest.raises(ValueError, match="several devices"):
        overlap_report(kernel_intervals_from_trace(trace))
    r = overlap_report(kernel_intervals_from_trace(trace, device=1), main_stream=7)
    assert r.overlapped_us == 5


def test_json_file_round_trip(tmp_path):
    plain = tmp_path / "trace.json"
    plain.write_text(json.dumps(TWO_STREAMS))
    packed = tmp_path / "trace.json.gz"
    with gzip.open(packed, "wt") as f:
        json.dump(TWO_STREAMS, f)
    expected = overlap_report(kernel_intervals_from_trace(TWO_STREAMS))
    assert overlap_report(kernel_intervals_from_trace(plain)) == expected
    assert overlap_report(kernel_intervals_from_trace(str(packed))) == expected
    assert json.loads(json.dumps(expected.to_dict()))["side_streams"] == [13]


def test_merge_intervals():
    assert merge_intervals([(5, 6), (0, 2), (1, 3), (3, 4), (10, 10)]) == [(0, 4), (5, 6), (10, 10)]
    assert merge_intervals([]) == []


def test_kernel_interval_rejects_negative_duration():
    with pytest.raises(ValueError):
        KernelInterval(stream=1, start_us=10.0, end_us=5.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_profile_steps_on_cpu_writes_trace_and_reports_zero(tmp_path):
    seen = []
    x = torch.randn(32, 32)

    def step(i):
        seen.append(i)
        return x @ x

    path = tmp_path / "sub" / "trace.json"
    r = profile_steps(step, steps=2, start_step=3, trace_path=path)
    assert seen == [3, 4]
    assert path.exists() and "traceEvents" in json.loads(path.read_text())
    assert (r.main_stream, r.side_busy_us, r.overlap_fraction) == (None, 0.0, 0.0)


def test_profile_steps_rejects_zero_steps(tmp_path):
    with pytest.raises(ValueError, match="steps"):
        profile_steps(lambda i: None, steps=0, start_step=0, trace_path=tmp_path / "t.json")


def _two_stream_step(work_main, work_side):
    """A step that forks a side stream off the current one, runs work on both, and joins."""
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()

    def step(i):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            work_side()
        work_main()
        main.wait_stream(side)

    return step


@pytest.mark.gpu
def test_profile_two_matmuls_on_two_streams_overlap(tmp_path):
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")

    def side_work():
        for _ in range(8):
            a @ a

    def main_work():
        for _ in range(8):
            b @ b

    step = _two_stream_step(main_work, side_work)
    step(0)
    torch.cuda.synchronize()
    r = profile_steps(step, steps=2, start_step=1, trace_path=tmp_path / "mm.json")
    assert r.main_stream is not None and len(r.side_streams) >= 1
    assert r.side_busy_us > 0
    assert r.overlap_fraction > 0


@pytest.mark.gpu
def test_profile_spin_kernels_on_two_streams_overlap_almost_fully(tmp_path):
    # One-thread spin kernels leave the GPU free, so the two streams must run side by side.
    step = _two_stream_step(lambda: torch.cuda._sleep(2_000_000), lambda: torch.cuda._sleep(2_000_000))
    step(0)
    torch.cuda.synchronize()
    r = profile_steps(step, steps=2, start_step=1, trace_path=tmp_path / "spin.json")
    assert r.overlap_fraction > 0.5


def test_overlap_matches_brute_force_on_random_integer_kernels():
    import random

    rng = random.Random(0)
    for _ in range(50):
        intervals = []
        for _ in range(rng.randint(1, 12)):
            start = rng.randint(0, 40)
            intervals.append(KernelInterval(stream=rng.choice([7, 13, 21]), start_us=start, end_us=start + rng.randint(0, 10)))
        r = overlap_report(intervals, main_stream=7)
        # Unit cells [t, t+1) covered by each side: a discrete stand-in for the interval union.
        main = {t for k in intervals if k.stream == 7 for t in range(int(k.start_us), int(k.end_us))}
        side = {t for k in intervals if k.stream != 7 for t in range(int(k.start_us), int(k.end_us))}
        assert (r.main_busy_us, r.side_busy_us, r.overlapped_us) == (len(main), len(side), len(main & side))


def test_a_trace_the_profiler_could_not_write_is_one_line(tmp_path, monkeypatch):
    """torch's profiler reports a failed write on stderr and returns (a full disk under bench
    --trace, "Failed to write to log file!"): reading it back was a FileNotFoundError traceback."""
    from erase_tune.errors import EraseTuneError

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", lambda self, path: None)  # wrote nothing
    x = torch.randn(8, 8)
    path = tmp_path / "trace.json"
    with pytest.raises(EraseTuneError, match=r"cannot write the trace .*trace\.json \(.*a full disk\?\)") as info:
        profile_steps(lambda i: x @ x, steps=1, start_step=0, trace_path=path)
    assert "\n" not in str(info.value)
