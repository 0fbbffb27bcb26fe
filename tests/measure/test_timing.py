"""Tests for interleaved step timing: call order, step indices, window labels, the clock."""

from __future__ import annotations

import time

import pytest
import torch

from erase_tune.measure import Timings, time_interleaved
from erase_tune.measure.timing import Steps, interleave


def _recording_runners(names, calls):
    def make(name):
        return lambda i: calls.append((name, i))

    return {name: make(name) for name in names}


def test_runs_each_runner_with_the_same_steps_in_rotated_order():
    calls = []
    result = time_interleaved(
        _recording_runners("AB", calls), device=torch.device("cpu"), warmup_steps=2, windows=3, window_steps=2, start_step=5
    )
    assert calls == [
        # warm-up: A then B
        ("A", 5), ("A", 6), ("B", 5), ("B", 6),
        # round 0: A B; round 1: B A; round 2: A B
        ("A", 7), ("A", 8), ("B", 7), ("B", 8),
        ("B", 9), ("B", 10), ("A", 9), ("A", 10),
        ("A", 11), ("A", 12), ("B", 11), ("B", 12),
    ]  # fmt: skip
    assert result.steps_run == 2 + 3 * 2
    assert result.next_step == 5 + 8
    assert result.clock == "perf_counter"
    for name in "AB":
        assert len(result.variants[name].steps_s) == 6
        assert result.variants[name].window == (0, 0, 1, 1, 2, 2)
        assert all(t >= 0 for t in result.variants[name].steps_s)


def test_three_runners_rotate_so_each_goes_first_once():
    calls = []
    time_interleaved(_recording_runners("ABC", calls), device=torch.device("cpu"), warmup_steps=0, windows=3, window_steps=1)
    assert [name for name, _ in calls] == list("ABC" "BCA" "CAB")
    for name in "ABC":
        assert [i for n, i in calls if n == name] == [0, 1, 2]


def test_slower_runner_measures_slower():
    runners = {"slow": lambda i: time.sleep(0.002), "fast": lambda i: None}
    result = time_interleaved(runners, device=torch.device("cpu"), warmup_steps=1, windows=2, window_steps=3)
    slow = sorted(result.variants["slow"].steps_s)
    fast = sorted(result.variants["fast"].steps_s)
    assert slow[0] >= 0.0019  # time.sleep never returns early
    assert fast[len(fast) // 2] < slow[len(slow) // 2] / 2


def test_to_dict_keeps_raw_samples():
    result = time_interleaved({"A": lambda i: None}, device="cpu", warmup_steps=0, windows=2, window_steps=2)
    raw = result.to_dict()
    assert raw["variants"]["A"]["window"] == [0, 0, 1, 1]
    assert raw["variants"]["A"]["steps_s"] == list(result.variants["A"].steps_s)
    assert raw["steps_run"] == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"warmup_steps": -1},
        {"windows": 0},
        {"window_steps": 0},
        {"window_steps": 1.5},
        {"start_step": -2},
        {"windows": True},
    ],
)
def test_rejects_bad_counts(kwargs):
    args = {"warmup_steps": 0, "windows": 1, "window_steps": 1} | kwargs
    with pytest.raises(ValueError):
        time_interleaved({"A": lambda i: None}, device=torch.device("cpu"), **args)


def test_rejects_no_runners_and_unsupported_device():
    with pytest.raises(ValueError, match="at least one runner"):
        time_interleaved({}, device=torch.device("cpu"), warmup_steps=0, windows=1, window_steps=1)
    with pytest.raises(ValueError, match="not supported"):
        time_interleaved({"A": lambda i: None}, device=torch.device("meta"), warmup_steps=0, windows=1, window_steps=1)


def test_timings_checks_lengths():
    with pytest.raises(ValueError, match="labels"):
        Timings(steps_s=(1.0, 2.0), window=(0,))


@pytest.mark.gpu
def test_cuda_events_time_device_work_not_host_launches():
    device = torch.device("cuda")
    # torch.cuda._sleep spins one GPU thread for N cycles and returns to the host at once:
    # a host clock would see ~0 s, device events see the spin.
    runners = {"spin": lambda i: torch.cuda._sleep(5_000_000), "idle": lambda i: None}
    start = time.perf_counter()
    result = time_interleaved(runners, device=device, warmup_steps=1, windows=2, window_steps=4)
    elapsed = time.perf_counter() - start
    assert result.clock == "cuda_event"
    spin = sorted(result.variants["spin"].steps_s)
    idle = sorted(result.variants["idle"].steps_s)
    assert spin[0] > 0.0005  # 5M cycles at <= 2.5 GHz is >= 2 ms; leave slack for clock boosts
    assert idle[len(idle) // 2] < spin[0] / 5
    # The per-step samples tile each window's device time, so they cannot exceed wall time.
    assert sum(spin) <= elapsed


def _schedule(names, order, windows):
    calls = []
    runners = _recording_runners(names, calls)

    def window(step, first, count, device):
        return [float(step(first + k) is None) for k in range(count)]

    interleave(runners, window, device=torch.device("cpu"), steps=Steps(warmup_steps=0, window_steps=1), windows=windows,
               order=order)
    return [calls[i:i + len(names)] for i in range(0, len(calls), len(names))]


def test_shuffled_rounds_give_every_runner_every_predecessor_where_rotation_gives_one():
    rounds = _schedule("ABCD", "shuffle", 200)
    assert all(sorted(n for n, _ in r) == list("ABCD") for r in rounds)
    for name in "ABCD":  # every runner still sees the same batch sequence
        assert [i for r in rounds for n, i in r if n == name] == list(range(200))
    before = {(r[k - 1][0], r[k][0]) for r in rounds for k in range(1, 4)}
    counts = {pair: sum((r[k - 1][0], r[k][0]) == pair for r in rounds for k in range(1, 4)) for pair in before}
    assert len(before) == 12 and min(counts.values()) >= 25  # all 4 x 3 ordered pairs, about 50 each
    assert _schedule("ABCD", "shuffle", 200) == rounds  # the same order at every call
    rotated = _schedule("ABCD", "rotate", 200)
    assert {r[k - 1][0] for r in rotated for k in range(1, 4) if r[k][0] == "B"} == {"A"}


def test_rejects_an_unknown_order():
    with pytest.raises(ValueError, match="order: 'random' is not one of rotate, shuffle"):
        _schedule("AB", "random", 1)


def test_after_round_drops_runners_and_after_warmup_runs_once_before_the_first_window():
    calls = []
    runners = _recording_runners("ABC", calls)
    events = []

    def window(step, first, count, device):
        return [float(step(first + k) is None) for k in range(count)]

    def after_round(round_index, got):
        events.append(("round", round_index, sorted(got)))
        return {"A", "B"} if round_index == 0 else {"A"}  # C leaves after round 0, B after round 1

    samples, labels = interleave(runners, window, device=torch.device("cpu"), windows=5,
                                 steps=Steps(warmup_steps=1, window_steps=2), after_warmup=lambda: events.append(("warm", len(calls))),
                                 after_round=after_round)
    assert events[0] == ("warm", 3)  # every runner's warm-up step, then the hook
    assert [e[2] for e in events[1:]] == [["A", "B", "C"], ["A", "B"], ["A"], ["A"], ["A"]]
    assert labels == {"A": [0, 0, 1, 1, 2, 2, 3, 3, 4, 4], "B": [0, 0, 1, 1], "C": [0, 0]}
    for name in "ABC":  # the ones that left saw a prefix of the same step indices
        assert [i for n, i in calls if n == name] == list(range(1 + len(labels[name])))
    with pytest.raises(ValueError, match="did not run"):
        interleave(runners, window, device=torch.device("cpu"), steps=Steps(warmup_steps=0, window_steps=1), windows=3,
                   after_round=lambda r, got: {"A"} if r == 0 else {"A", "B"})
    # A hook that names no runner ends the rounds.
    _, labels = interleave(runners, window, device=torch.device("cpu"), steps=Steps(warmup_steps=0, window_steps=1),
                           windows=9, after_round=lambda r, got: set())
    assert labels == {"A": [0], "B": [0], "C": [0]}
