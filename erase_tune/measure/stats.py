"""Throughput statistics over per-step times: p90/median QPS and window-paired ratios.

Pure functions over floats (numpy only), so they are easy to test and to re-run on the raw
samples a trial stores.

* Per-step QPS is ``batch_size / step_time``. The paper reports the fast end of it: p90 is
  the 90th percentile of per-step QPS (``numpy.percentile(qps, 90)``, linear interpolation),
  not the QPS of the 90th-percentile step time.
* A ratio between two variants is taken window by window (docs/design.md: the eager baseline
  drifts between runs, so a ratio is only meaningful between samples taken side by side);
  its spread over windows is what a reader needs to judge a 1-2% gain.
* :func:`t_interval` is the 95% Student-t interval of a mean over windows (or over seeds): what
  the sequential protocol (:mod:`erase_tune.measure.protocol`) stops on, and what confirmations
  report.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np

__all__ = ["QpsSummary", "RatioSpread", "WindowedSamples", "per_step_qps", "qps_summary", "ratio_spread", "gain",
           "t_interval"]

Statistic = Literal["median", "p90"]

# Two-sided 97.5% quantiles of Student's t by degrees of freedom (1..30); beyond, the normal's
# (1.96 against 2.042 at 30: an interval of 31+ windows is at most 4% too narrow).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


class WindowedSamples(Protocol):
    """Per-step times tagged with their window, e.g. :class:`~erase_tune.measure.timing.Timings`."""

    @property
    def steps_s(self) -> Sequence[float]: ...

    @property
    def window(self) -> Sequence[int]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class QpsSummary:
    """Throughput of one variant, in samples per second."""

    p90: float
    """90th percentile of per-step QPS: the paper's headline figure (the fast end)."""
    median: float
    """Median per-step QPS."""
    mean: float
    """Total samples / total time: the throughput a long run sees. This is the harmonic mean
    of per-step QPS, not the arithmetic one (which slow steps would barely move)."""
    n: int
    """Number of steps summarised."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RatioSpread:
    """Ratio of a variant's QPS to a reference's, taken per interleaved window."""

    median: float
    """Median over windows of the per-window ratio: the figure to report."""
    lo: float
    """Smallest per-window ratio."""
    hi: float
    """Largest per-window ratio."""
    per_window: tuple[float, ...]
    """The per-window ratios, in window order."""
    statistic: str
    """Which per-window QPS statistic was compared: ``"median"`` or ``"p90"``."""


def per_step_qps(step_times_s: Sequence[float], batch_size: int) -> np.ndarray:
    """``batch_size / t`` for each step time ``t`` (seconds), after checking the inputs."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size: {batch_size!r} must be a positive integer")
    times = np.asarray(step_times_s, dtype=np.float64)
    if times.ndim != 1 or times.size == 0:
        raise ValueError("step_times_s: need a non-empty flat sequence of step times")
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ValueError("step_times_s: every step time must be a finite number of seconds > 0")
    return batch_size / times


def qps_summary(step_times_s: Sequence[float], batch_size: int) -> QpsSummary:
    """p90, median and mean QPS of the given step times."""
    qps = per_step_qps(step_times_s, batch_size)
    return QpsSummary(
        p90=float(np.percentile(qps, 90)),
        median=float(np.median(qps)),
        mean=float(qps.size * batch_size / np.sum(np.asarray(step_times_s, dtype=np.float64))),
        n=int(qps.size),
    )


def ratio_spread(
    variant: WindowedSamples,
    reference: WindowedSamples,
    batch_size: int,
    *,
    statistic: Statistic = "median",
) -> RatioSpread:
    """Per-window QPS ratio of ``variant`` over ``reference`` and its spread across windows.

    In each window that both variants have samples in, take the chosen statistic of per-step
    QPS of each and divide; report the median, min and max of those ratios. The same batch
    size applies to both (they run the same workload), so it cancels but is still checked.
    """
    if statistic not in ("median", "p90"):
        raise ValueError(f"statistic: {statistic!r} must be 'median' or 'p90'")
    ours = _by_window(variant)
    theirs = _by_window(reference)
    shared = sorted(set(ours) & set(theirs))
    if not shared:
        raise ValueError("variant and reference share no window: they were not timed side by side")
    ratios = tuple(
        _statistic(per_step_qps(ours[w], batch_size), statistic) / _statistic(per_step_qps(theirs[w], batch_size), statistic)
        for w in shared
    )
    return RatioSpread(
        median=float(np.median(ratios)),
        lo=min(ratios),
        hi=max(ratios),
        per_window=ratios,
        statistic=statistic,
    )


def gain(a: float, b: float) -> float:
    """Relative gain of ``a`` over ``b``: ``a / b - 1`` (0.0951 means +9.51%)."""
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        raise ValueError(f"gain: need finite values and a reference > 0, got {a!r} / {b!r}")
    return a / b - 1.0


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and two-sided 95% Student-t interval of the mean: ``(mean, lo, hi)``. One value gives a
    zero-width interval (there is no spread to judge it by: callers that stop on the width need
    at least two)."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("t_interval: need a non-empty flat sequence of values")
    mean = float(x.mean())
    if x.size < 2:
        return mean, mean, mean
    df = x.size - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96
    half = t * float(x.std(ddof=1)) / math.sqrt(x.size)
    return mean, mean - half, mean + half


def _by_window(samples: WindowedSamples) -> dict[int, list[float]]:
    if len(samples.steps_s) != len(samples.window):
        raise ValueError("steps_s and window must have the same length")
    groups: dict[int, list[float]] = {}
    for t, w in zip(samples.steps_s, samples.window):
        groups.setdefault(int(w), []).append(float(t))
    return groups


def _statistic(qps: np.ndarray, statistic: Statistic) -> float:
    return float(np.percentile(qps, 90)) if statistic == "p90" else float(np.median(qps))
