"""Tests for QPS statistics and window-paired ratios, on hand-computed examples."""

from __future__ import annotations

import pytest

from erase_tune.measure import Timings, gain, per_step_qps, qps_summary, ratio_spread


def test_qps_summary_on_known_steps():
    # batch 10 and step times 10/q give per-step QPS q = 1..10.
    times = [10 / q for q in range(1, 11)]
    s = qps_summary(times, 10)
    # numpy linear percentile: rank 0.9 * 9 = 8.1 -> 9 + 0.1 * (10 - 9)
    assert s.p90 == pytest.approx(9.1)
    assert s.median == pytest.approx(5.5)
    # mean = total samples / total time = 100 / sum(10/q)
    assert s.mean == pytest.approx(100 / sum(10 / q for q in range(1, 11)))
    assert s.n == 10


def test_p90_is_the_fast_end():
    s = qps_summary([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 1.0], 100)
    assert s.p90 == pytest.approx(1000.0)  # slow outlier does not move the fast end
    assert s.median == pytest.approx(1000.0)
    assert s.mean == pytest.approx(1000 / 1.9)  # but throughput feels it


def test_single_step():
    s = qps_summary([0.5], 4)
    assert (s.p90, s.median, s.mean, s.n) == (8.0, 8.0, 8.0, 1)


@pytest.mark.parametrize("times", [[], [0.1, 0.0], [0.1, -1.0], [float("nan")], [float("inf")]])
def test_rejects_bad_times(times):
    with pytest.raises(ValueError):
        qps_summary(times, 8)


@pytest.mark.parametrize("batch", [0, -1, 2.5, True])
def test_rejects_bad_batch(batch):
    with pytest.raises(ValueError, match="batch_size"):
        per_step_qps([0.1], batch)


def test_ratio_spread_per_window():
    # Window 0: variant 2x faster; window 1: 1.5x; window 2: 1.25x (baseline drifting).
    variant = Timings(steps_s=(0.5, 0.5, 0.5, 0.5, 0.4, 0.4), window=(0, 0, 1, 1, 2, 2))
    reference = Timings(steps_s=(1.0, 1.0, 0.75, 0.75, 0.5, 0.5), window=(0, 0, 1, 1, 2, 2))
    r = ratio_spread(variant, reference, 32)
    assert r.per_window == pytest.approx((2.0, 1.5, 1.25))
    assert r.median == pytest.approx(1.5)
    assert (r.lo, r.hi) == (pytest.approx(1.25), pytest.approx(2.0))
    assert r.statistic == "median"


def test_ratio_spread_uses_median_within_window_and_only_shared_windows():
    # Window 0 medians: variant QPS 1/0.1=10 (times 0.1, 0.1, 9.0), reference 1/0.2=5.
    variant = Timings(steps_s=(0.1, 0.1, 9.0, 0.1), window=(0, 0, 0, 3))
    reference = Timings(steps_s=(0.2, 0.2, 0.2, 1.0), window=(0, 0, 0, 1))
    r = ratio_spread(variant, reference, 1)
    assert r.per_window == pytest.approx((2.0,))


def test_ratio_spread_p90():
    # Per-step QPS variant 1..10 in window 0, reference constant 5: p90 ratio = 9.1 / 5.
    variant = Timings(steps_s=tuple(1 / q for q in range(1, 11)), window=(0,) * 10)
    reference = Timings(steps_s=(0.2,) * 4, window=(0,) * 4)
    r = ratio_spread(variant, reference, 1, statistic="p90")
    assert r.median == pytest.approx(9.1 / 5)


def test_ratio_spread_rejects_unpaired_samples_and_bad_statistic():
    a = Timings(steps_s=(0.1,), window=(0,))
    b = Timings(steps_s=(0.1,), window=(1,))
    with pytest.raises(ValueError, match="share no window"):
        ratio_spread(a, b, 1)
    with pytest.raises(ValueError, match="statistic"):
        ratio_spread(a, a, 1, statistic="mean")


def test_gain():
    assert gain(1.0951, 1.0) == pytest.approx(0.0951)
    assert gain(0.81, 1.0) == pytest.approx(-0.19)
    with pytest.raises(ValueError):
        gain(1.0, 0.0)
    with pytest.raises(ValueError):
        gain(float("nan"), 1.0)
