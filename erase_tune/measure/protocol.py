"""The one sequential, interleaved timing protocol: measure until each gain is known well enough.

On a host-bound eager step (the reference DLRM at batch 4096 on an H200) one timing window's
QPS moves by ±10–15% from the next, for the same code. A fixed number of windows then ranks
the luckiest plans first: the fast end of a few windows is mostly luck. So every gain
erase-tune reports (a trial's, a confirmation's, a bench row's) comes from here:

* **Interleaved, in one process.** Every runner is warmed up (then a device sync), then runs
  one window per round, the rounds' orders rotated (:func:`erase_tune.measure.timing.interleave`,
  the one loop). Every runner's k-th step gets global step index ``start_step + k``: all see
  the same batch sequence.
* **A gain per round.** ``pairs`` names, for each plan, the runner it is compared with (and any
  further ones). In round ``r`` plan P's gain over reference R is
  ``median per-step QPS of P in r / median per-step QPS of R in r - 1``: window medians, so one
  slow step does not move it, and windows of the same round, taken side by side, so slow drift
  cancels (docs/design.md, measurement rule 1).
* **A robust estimate with an interval.** Over the rounds, a plan's gain is the mean of its
  per-round gains with a 95% Student-t interval (:func:`erase_tune.measure.stats.t_interval`);
  the median of the per-round gains is kept beside it. One lucky window moves the mean by its
  excess over the number of windows, where it can move the fast end of pooled steps (the p90
  a study used to rank by) by all of it.
* **Sequential stopping (racing).** After each round from ``rule.min_windows`` on, each plan
  still measured is checked against its first (primary) reference: it stops ``narrow`` once the
  interval's half-width is at most ``rule.halfwidth``, ``behind`` once its upper bound is below
  ``rule.below`` (it cannot reach the front: F-race, successive halving), and ``cap`` at
  ``rule.max_windows``. No stop on the interval is taken from fewer than two windows (one has
  no spread). A plan that stopped leaves the rotation; a reference runs while any plan that
  compares with it still does; a runner no longer needed stops.

``window`` replaces the device clock (a seeded fake window drives the protocol deterministically
on the CPU in the tests); ``agree`` makes the ranks of a data-parallel measurement decide on the
same numbers (rank 0's), so that they keep running the same runners.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np
import torch

from erase_tune.errors import EraseTuneError
from erase_tune.measure.stats import t_interval
from erase_tune.measure.timing import (
    InterleavedTimings,
    StepRunner,
    Steps,
    Timings,
    WindowMeasure,
    interleave,
    window_measure,
)

__all__ = ["STOPS", "StopRule", "GainEstimate", "ProtocolResult", "ProtocolHooks", "Steps", "measure_gains",
           "window_gain", "estimate"]

log = logging.getLogger("erase_tune.measure")
"""Where the protocol says what it is about to time (INFO: a command's console shows it; a trial
worker, whose logging is not configured, does not)."""

STOPS = ("narrow", "behind", "cap")
"""Why a plan stopped being measured: its interval was narrow enough, it was behind the bound
it raced against, or it reached the window cap."""

Agree = Callable[[list[float]], Sequence[float]]
"""This round's gains (in a fixed order) -> the gains every rank acts on (data parallel: rank 0's)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopRule:
    """When a plan has been measured enough."""

    min_windows: int = 4
    """Rounds before any stop is considered (an interval needs 2: below that only the cap stops)."""
    max_windows: int = 20
    """The cap (>= min_windows); ``min_windows == max_windows`` is a fixed number of windows."""
    halfwidth: float = 0.03
    """A plan stops once its 95% interval's half-width is at most this (0 < h < 1; 0.03 = ±3%)."""
    below: float | None = None
    """Racing: a plan stops once its interval's upper bound is below this gain (None: no race)."""

    def __post_init__(self) -> None:
        for name in ("min_windows", "max_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
                raise EraseTuneError(f"stop_rule.{name}: {value!r} must be an integer in 1..1000000")
        if self.max_windows < self.min_windows:
            raise EraseTuneError(f"stop_rule.max_windows: {self.max_windows} must be >= min_windows "
                                 f"({self.min_windows})")
        if not _number(self.halfwidth) or not 0 < self.halfwidth < 1:
            raise EraseTuneError(f"stop_rule.halfwidth: {self.halfwidth!r} must be a number in (0, 1)")
        if self.below is not None and not _number(self.below):
            raise EraseTuneError(f"stop_rule.below: {self.below!r} must be a finite number or None")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProtocolHooks:
    """What a caller plugs into :func:`measure_gains` (each optional)."""

    window: WindowMeasure | None = None
    """Replaces the device clock (a seeded fake window drives the protocol on the CPU in tests)."""
    after_warmup: Callable[[], None] | None = None
    """Called once after the warm-up and its device sync, before the first timed window."""
    agree: Agree | None = None
    """Maps each round's gains to the ones acted on (data parallel: rank 0's, broadcast)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GainEstimate:
    """One plan's gain over one reference, from the rounds both ran in."""

    gain: float
    """Mean over windows of the per-window gain: the interval's centre, the robust estimate a study ranks by."""
    median: float
    """Median of the per-window gains."""
    lo: float
    """Lower end of the 95% Student-t interval of the mean."""
    hi: float
    """Upper end of that interval."""
    per_window: tuple[float, ...]
    """The per-window gains, in round order (window-median QPS ratio - 1)."""
    windows: int
    """Windows (rounds) the gain was measured over."""
    stopped: str
    """Why measuring stopped: ``narrow``, ``behind`` or ``cap`` (:data:`STOPS`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_window", tuple(float(g) for g in self.per_window))
        if self.windows != len(self.per_window) or self.windows < 1:
            raise ValueError(f"GainEstimate: windows {self.windows} must be the number of per-window gains "
                             f"({len(self.per_window)}), at least 1")
        if self.stopped not in STOPS:
            raise ValueError(f"GainEstimate: stopped {self.stopped!r} is not one of {', '.join(STOPS)}")
        if not self.lo <= self.gain <= self.hi:
            raise ValueError(f"GainEstimate: the interval [{self.lo}, {self.hi}] must hold the gain {self.gain}")

    @property
    def halfwidth(self) -> float:
        """Half the interval's width: the ± a reader can trust the gain to."""
        return (self.hi - self.lo) / 2

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        out = dataclasses.asdict(self)
        out["per_window"] = list(self.per_window)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProtocolResult:
    """What :func:`measure_gains` measured."""

    timings: InterleavedTimings
    """Every runner's per-step samples, each labelled with its round."""
    gains: dict[str, GainEstimate]
    """Each plan's gain over its primary (first) reference."""
    pair_gains: dict[tuple[str, str], GainEstimate]
    """Every ``(plan, reference)`` pair's gain, the primary ones included."""
    rounds: int
    """Rounds run (the most windows any runner ran)."""
    next_steps: dict[str, int]
    """The global step index each runner would get next (runners that stopped early are behind)."""

    def vs(self, plan: str, reference: str) -> GainEstimate:
        """``plan``'s gain over ``reference``."""
        return self.pair_gains[(plan, reference)]


def window_gain(plan_steps_s: Sequence[float], reference_steps_s: Sequence[float]) -> float:
    """Median per-step QPS of one window of the plan over the reference's window, minus 1
    (the batch, the same for both, cancels)."""
    return _median_qps(plan_steps_s) / _median_qps(reference_steps_s) - 1.0


def estimate(per_window: Sequence[float], stopped: str) -> GainEstimate:
    """The :class:`GainEstimate` of these per-window gains."""
    mean, lo, hi = t_interval(per_window)
    return GainEstimate(gain=mean, median=float(np.median(per_window)), lo=min(lo, mean), hi=max(hi, mean),
                        per_window=tuple(per_window), windows=len(per_window), stopped=stopped)


def measure_gains(
    runners: Mapping[str, StepRunner],
    *,
    device: torch.device | str,
    steps: Steps,
    rule: StopRule,
    pairs: Mapping[str, str | Sequence[str]],
    deciding: Collection[str] | None = None,
    hooks: ProtocolHooks = ProtocolHooks(),
) -> ProtocolResult:
    """Time ``runners`` interleaved until every plan's gain is known well enough; see the module
    docstring.

    ``steps``: the warm-up steps per runner, the steps per window and the first step index.
    ``pairs``: plan -> the runner it is compared with, or several (the first is the primary
    reference, whose interval the stop rule reads; e.g. ``{"candidate": ("baseline",
    "reference"), "detach_only": "baseline"}``). A runner may be a plan and a reference at once;
    every runner must be one of them. ``deciding``: the plans the stop rule applies to (default:
    every plan); the other plans are measured while any deciding plan is, and stop with the
    reason of the deciding plan whose stop ended them (the first in ``deciding`` order among
    those that stopped last). ``hooks.after_warmup``: called once after the warm-up and its device
    sync, before the first timed window. ``hooks.agree``: maps each round's gains (every measured
    pair, sorted by plan then reference) to the ones acted on (data parallel: a broadcast from
    rank 0, so every rank stops the same runners). ``hooks.window``: replaces the device clock.
    """
    warmup_steps, window_steps, start_step = steps.warmup_steps, steps.window_steps, steps.start_step
    window, after_warmup, agree = hooks.window, hooks.after_warmup, hooks.agree
    if not runners:
        raise ValueError("runners: need at least one runner to time")
    for name, value in (("warmup_steps", warmup_steps), ("window_steps", window_steps), ("start_step", start_step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "window_steps" else 0):
            raise ValueError(f"{name}: {value!r} must be an integer >= {1 if name == 'window_steps' else 0}")
    race = _Race(runners, _pairs(runners, pairs), deciding, rule, agree)
    device = torch.device(device)
    clock = window if window is not None else window_measure(device)

    def warmed_up() -> None:  # the long part is the windows: say what they are before the first
        log.info(f"timing {', '.join(runners)} in turn: {rule.min_windows}-{rule.max_windows} windows of "
                 f"{window_steps:,} steps each, until each gain's 95% interval is within ±{rule.halfwidth:.0%}; "
                 "Ctrl-C stops")
        if after_warmup is not None:
            after_warmup()

    if warmup_steps:  # --warmup 1000000 is hours: say what runs before the first window
        log.info(f"warming up {', '.join(runners)} in turn: {warmup_steps:,} steps each before timing; Ctrl-C stops")
    samples, labels = interleave(runners, clock, device=device, steps=steps, windows=rule.max_windows,
                                 after_warmup=warmed_up, after_round=race.after_round)
    next_steps = {n: start_step + warmup_steps + race.rounds_run[n] * window_steps for n in runners}
    most = max(next_steps.values()) - start_step
    timings = InterleavedTimings(
        variants={n: Timings(steps_s=tuple(samples[n]), window=tuple(labels[n])) for n in runners},
        steps_run=most, next_step=start_step + most,
        clock="custom" if window is not None else "cuda_event" if device.type == "cuda" else "perf_counter",
    )
    pair_gains = {key: estimate(g, race.stopped[key[0]]) for key, g in race.per_pair.items()}
    return ProtocolResult(timings=timings, gains={p: pair_gains[(p, race.refs[p][0])] for p in race.order},
                          pair_gains=pair_gains, rounds=max(race.rounds_run.values()), next_steps=next_steps)


class _Race:
    """The sequential protocol's bookkeeping over the rounds: every pair's per-round gains, which
    plans stopped and why, and the rounds each runner ran; :meth:`after_round` is
    :func:`~erase_tune.measure.timing.interleave`'s ``after_round``."""

    def __init__(self, runners: Mapping[str, StepRunner], refs: dict[str, tuple[str, ...]],
                 deciding: Collection[str] | None, rule: StopRule, agree: Agree | None) -> None:
        self.refs, self.rule, self.agree = refs, rule, agree
        self.order = list(refs)
        self.deciders = self.order if deciding is None else [p for p in deciding]
        if not set(self.deciders) <= set(self.order) or (self.order and not self.deciders):
            raise ValueError(f"deciding: {sorted(self.deciders)} must be a non-empty subset of the plans {self.order}")
        self.per_pair: dict[tuple[str, str], list[float]] = {(p, r): [] for p in self.order for r in refs[p]}
        self.stopped: dict[str, str] = {}
        self.rounds_run = {name: 0 for name in runners}

    def needed(self) -> set[str]:
        """The runners the next round needs: the plans still measured and their references."""
        live = [p for p in self.order if p not in self.stopped]
        return {*live, *(r for p in live for r in self.refs[p])}

    def after_round(self, round_index: int, got: Mapping[str, list[float]]) -> Collection[str]:
        """Record one round's gains, stop the plans the rule stops, and name the runners still needed."""
        for name in got:
            self.rounds_run[name] += 1
        live = [p for p in self.order if p not in self.stopped]
        self._record(got, live)
        ended: list[str] = []
        for p in self.deciders:
            if p in self.stopped:
                continue
            reason = _stop(self.per_pair[(p, self.refs[p][0])], self.rule)
            if reason is not None:
                self.stopped[p] = reason
                ended.append(p)
        if ended and all(p in self.stopped for p in self.deciders):
            for p in live:  # the plans measured alongside end with the last deciding plan
                self.stopped.setdefault(p, self.stopped[ended[0]])
        return self.needed()

    def _record(self, got: Mapping[str, list[float]], live: list[str]) -> None:
        """This round's window gain of every live pair (the ones ``agree`` returns, where given)."""
        keys = sorted((p, r) for p in live for r in self.refs[p])
        gains = [window_gain(got[p], got[r]) for p, r in keys]
        if self.agree is not None and keys:
            gains = [float(g) for g in self.agree(gains)]
            if len(gains) != len(keys):
                raise ValueError(f"agree: returned {len(gains)} gains for {len(keys)} pairs")
        for key, g in zip(keys, gains):
            self.per_pair[key].append(g)


def _stop(gains: list[float], rule: StopRule) -> str | None:
    """Why a plan with these per-window gains stops now, or None to keep measuring it."""
    n = len(gains)
    if n < rule.min_windows:
        return None
    if n >= 2:
        _, lo, hi = t_interval(gains)
        if (hi - lo) / 2 <= rule.halfwidth:
            return "narrow"
        if rule.below is not None and hi < rule.below:
            return "behind"
    return "cap" if n >= rule.max_windows else None


def _pairs(runners: Mapping[str, StepRunner], pairs: Mapping[str, str | Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """``pairs`` with every value a tuple of references, checked against ``runners``."""
    refs: dict[str, tuple[str, ...]] = {}
    for plan, value in pairs.items():
        got = (value,) if isinstance(value, str) else tuple(value)
        if plan not in runners or not got or any(r not in runners for r in got):
            raise ValueError(f"pairs: {plan!r} -> {got!r} names a runner that is not in runners ({list(runners)})")
        if plan in got or len(set(got)) != len(got):
            raise ValueError(f"pairs: {plan!r} -> {got!r}: a plan is compared with other runners, each once")
        refs[plan] = got
    unpaired = set(runners) - set(refs) - {r for got in refs.values() for r in got}
    if unpaired:
        raise ValueError(f"pairs: runners {sorted(unpaired)} are neither a plan nor a reference")
    return refs


def _median_qps(steps_s: Sequence[float]) -> float:
    times = np.asarray(steps_s, dtype=np.float64)
    if times.ndim != 1 or times.size == 0 or not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ValueError("window: need at least one step time, each a finite number of seconds > 0")
    return float(np.median(1.0 / times))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
