"""Hypervolume of a tuning job's results within its NE budget, exactly, in two dimensions.

A job maximizes QPS gain and minimizes NE gap. The hypervolume of a set of trials is the area
of the (gain, NE gap) plane their points dominate, measured from the reference point
``(gain 0, NE gap = max_ne_gap)``: the baseline's speed at the largest quality loss the job
accepts. So only plans that are faster than the baseline *and* within the budget add
anything, and one number says how much of the trade-off a job (or a sampler) has found. It
only grows as trials are added, which makes ``hypervolume_history`` a fair way to compare
samplers trial by trial.

The area is a union of rectangles ``[0, gain] x [gap, max_ne_gap]``; a sweep over the points
in decreasing gain adds each horizontal strip once, so it is exact (no sampling) and
``O(n log n)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["hypervolume", "hypervolume_history"]


def _check(point: tuple[float, float]) -> tuple[float, float]:
    gain, gap = float(point[0]), float(point[1])
    if not (math.isfinite(gain) and math.isfinite(gap)):
        # A NaN would silently drop out of every comparison and an inf would make the area inf:
        # a trial that measured either must not be COMPLETE in the first place.
        raise ValueError(f"hypervolume: point {point!r} is not finite")
    return gain, gap


def hypervolume(points: Iterable[tuple[float, float]], max_ne_gap: float) -> float:
    """Area dominated by ``points`` (``(qps_gain, ne_gap)``; maximize gain, minimize gap)
    relative to the reference point ``(0, max_ne_gap)``.

    Points with gain <= 0 or gap >= ``max_ne_gap`` dominate none of that region and add
    nothing; repeated and dominated points add nothing either.
    """
    budget = float(max_ne_gap)
    if not math.isfinite(budget):
        raise ValueError(f"hypervolume: max_ne_gap {max_ne_gap!r} is not finite")
    useful = [(g, n) for g, n in map(_check, points) if g > 0.0 and n < budget]
    # Decreasing gain (ties: lower gap first). Each point extends the covered band of gaps
    # downwards from the lowest gap seen so far, over a width equal to its own gain, which is
    # the widest any point can cover there since all earlier points had larger gains but
    # higher gaps.
    useful.sort(key=lambda p: (-p[0], p[1]))
    area, lowest = 0.0, budget
    for gain, gap in useful:
        if gap < lowest:
            area += gain * (lowest - gap)
            lowest = gap
    return area


def hypervolume_history(trials_in_order: Iterable[tuple[float, float] | None], max_ne_gap: float) -> list[float]:
    """``[hypervolume(first k points) for k = 1..n]``, non-decreasing.

    An entry of ``None`` is a trial that produced no point (failed, or still running); it keeps
    its place so that entry ``k - 1`` belongs to trial ``k - 1`` of the study.
    """
    history: list[float] = []
    seen: list[tuple[float, float]] = []
    current = 0.0
    for point in trials_in_order:
        if point is not None:
            seen.append(_check(point))
            # Recomputed from all points (a study has hundreds of trials, not millions). A new
            # point can only add area, but a different summation order can round a hair lower:
            # keep the history monotone, as the true value is.
            current = max(current, hypervolume(seen, max_ne_gap))
        history.append(current)
    return history
