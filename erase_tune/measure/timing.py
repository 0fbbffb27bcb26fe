"""Interleaved, device-side timing of training steps for several variants in one process.

The first measurement rule (docs/design.md): baseline and candidate run in the same process on the
same device, alternating in windows after warm-up, and a gain is a ratio of the two. The
CPU-launch-bound eager baseline drifts from run to run (1.11x one run, 1.19x the next), so
only variants timed side by side, window against window, can be compared.

:func:`time_interleaved` runs every variant ("runner") for the same global step indices,
so all variants train on the same batch sequence, and times each step on the device:

* CUDA: ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream between
  steps; the host synchronizes once per window (never per step, which would hide the
  CPU/GPU pipelining a real training loop gets) and then reads ``elapsed_time``.
* CPU: ``time.perf_counter()`` around each step (CPU work is synchronous).

A runner is ``step(i) -> Any``: one full training step for global step ``i``. Before it
returns it must join any side streams back into the current stream (and any worker thread
it dispatched to), so that work recorded after it is ordered behind all of its work.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

__all__ = ["StepRunner", "Steps", "Timings", "InterleavedTimings", "WindowMeasure", "RoundDone", "interleave",
           "time_interleaved", "window_measure"]

StepRunner = Callable[[int], Any]
"""One full training step for the given global step index; its return value is ignored."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Steps:
    """How many steps an interleaved measurement runs: ``warmup_steps`` untimed per runner, then
    windows of ``window_steps`` timed steps; every runner's step indices count from ``start_step``."""

    warmup_steps: int
    window_steps: int
    start_step: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timings:
    """Per-step times of one variant, in execution order, each tagged with its window."""

    steps_s: tuple[float, ...]
    """Seconds per timed step, device-side."""
    window: tuple[int, ...]
    """``window[k]`` is the interleaving round (0-based) in which ``steps_s[k]`` was taken."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps_s", tuple(float(t) for t in self.steps_s))
        object.__setattr__(self, "window", tuple(int(w) for w in self.window))
        if len(self.steps_s) != len(self.window):
            raise ValueError(f"steps_s has {len(self.steps_s)} samples but window has {len(self.window)} labels")

    def to_dict(self) -> dict[str, list[float] | list[int]]:
        """The raw samples as JSON-ready lists (docs/design.md: record the raw per-step samples)."""
        return {"steps_s": list(self.steps_s), "window": list(self.window)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class InterleavedTimings:
    """What :func:`time_interleaved` measured, and how far it moved each runner."""

    variants: dict[str, Timings]
    """Timed samples per runner name, in the order the runners were given."""
    steps_run: int
    """Training steps each runner has now done (warm-up included). All runners did the same in
    :func:`time_interleaved`; in the sequential protocol, this is the most any runner did (those
    that stopped early did fewer: ``ProtocolResult.next_steps``)."""
    next_step: int
    """``start_step + steps_run``: the global step index the furthest runner would get next."""
    clock: str
    """``"cuda_event"`` or ``"perf_counter"``: which clock produced the samples."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form with every raw sample."""
        return {
            "variants": {name: t.to_dict() for name, t in self.variants.items()},
            "steps_run": self.steps_run,
            "next_step": self.next_step,
            "clock": self.clock,
        }


def time_interleaved(
    runners: Mapping[str, StepRunner],
    *,
    device: torch.device,
    warmup_steps: int,
    windows: int,
    window_steps: int,
    start_step: int = 0,
) -> InterleavedTimings:
    """Warm every runner up, then time them in alternating windows on ``device``.

    Order of work, for runners ``A, B, C``:

    1. warm-up: ``A`` runs ``warmup_steps`` untimed steps, then ``B``, then ``C``;
    2. ``windows`` rounds; round ``r`` runs the runners in the order rotated left by ``r``
       (``ABC``, ``BCA``, ``CAB``, ...), each for ``window_steps`` consecutive timed steps.
       Rotation keeps any variant from always going first (right after another variant's
       sync, with warm caches of its own); with two runners it gives the counterbalanced
       ``AB BA AB BA`` pattern, which also cancels linear drift.

    Every runner keeps its own step counter starting at ``start_step``: its k-th call (warm-up
    included) gets index ``start_step + k``, so all variants see the same batch sequence.
    """
    if not runners:
        raise ValueError("runners: need at least one runner to time")
    _check_count("warmup_steps", warmup_steps, minimum=0)
    _check_count("windows", windows, minimum=1)
    _check_count("window_steps", window_steps, minimum=1)
    _check_count("start_step", start_step, minimum=0)
    device = torch.device(device)
    window_timer = window_measure(device)
    names = list(runners)
    samples, labels = interleave(runners, window_timer, device=device, windows=windows,
                                 steps=Steps(warmup_steps=warmup_steps, window_steps=window_steps,
                                             start_step=start_step))

    steps_run = warmup_steps + windows * window_steps
    return InterleavedTimings(
        variants={name: Timings(steps_s=tuple(samples[name]), window=tuple(labels[name])) for name in names},
        steps_run=steps_run,
        next_step=start_step + steps_run,
        clock="cuda_event" if device.type == "cuda" else "perf_counter",
    )


WindowMeasure = Callable[[StepRunner, int, int, torch.device], list[float]]
"""``(runner, first step index, steps, device) -> samples``: runs one window and measures it."""


def window_measure(device: torch.device) -> WindowMeasure:
    """The device-side window clock for ``device``: CUDA events on CUDA, the host clock on the CPU."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device} is not supported for timing (only cpu and cuda)")
    return _cuda_window if device.type == "cuda" else _cpu_window


ORDERS = ("rotate", "shuffle")
"""How :func:`interleave` orders the runners within a round: ``rotate`` (round ``r`` rotated left
by ``r``), or ``shuffle`` (a fresh order per round, drawn from a fixed seed)."""


RoundDone = Callable[[int, Mapping[str, list[float]]], Collection[str]]
"""``(round index, samples of this round by runner) -> runners that run in the next round``."""


def interleave(runners: Mapping[str, StepRunner], window: WindowMeasure, *, device: torch.device, steps: Steps,
               windows: int, order: str = "rotate", after_warmup: Callable[[], None] | None = None,
               after_round: RoundDone | None = None) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """The schedule of :func:`time_interleaved` with any window measurement: warm-up
    (``steps.warmup_steps`` per runner), a device sync, ``after_warmup()``, then at most
    ``windows`` rounds of ``steps.window_steps`` steps. Returns each runner's samples and, per
    sample, its round.

    Rotation keeps each runner's predecessor fixed (with three or more runners, ``B`` follows
    ``A`` in every round but one). Where what a runner costs depends on the one before it, as
    host CPU time per single step can, ``order="shuffle"`` gives every runner every predecessor
    about equally often, in the same order at every call.

    ``after_round`` (the sequential protocol, :mod:`erase_tune.measure.protocol`): called after
    every round with that round's samples, it names the runners that run in the next one (a
    subset of this round's); the rounds end early when it names none. A runner that leaves
    keeps the step indices it has used: every runner's calls are still ``start_step``,
    ``start_step + 1``, ... (the ones that stop early see a prefix of the same batch sequence).
    The remaining runners are rotated among themselves."""
    if order not in ORDERS:
        raise ValueError(f"order: {order!r} is not one of {', '.join(ORDERS)}")
    warmup_steps, window_steps, start_step = steps.warmup_steps, steps.window_steps, steps.start_step
    names = list(runners)
    rng = random.Random(0)
    next_index = {name: start_step for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    labels: dict[str, list[int]] = {name: [] for name in names}
    for name in names:
        for _ in range(warmup_steps):
            runners[name](next_index[name])
            next_index[name] += 1
    # Warm-up work still queued on the device must not leak into the first timed window.
    _synchronize(device)
    if after_warmup is not None:
        after_warmup()
    active = names
    for round_index in range(windows):
        if not active:
            break
        shift = round_index % len(active)
        ordered = active[shift:] + active[:shift]
        if order == "shuffle":
            rng.shuffle(ordered)
        this_round: dict[str, list[float]] = {}
        for name in ordered:
            first = next_index[name]
            got = window(runners[name], first, window_steps, device)
            next_index[name] = first + window_steps
            samples[name].extend(got)
            labels[name].extend([round_index] * len(got))
            this_round[name] = list(got)
        if after_round is not None:
            keep = set(after_round(round_index, this_round))
            if not keep <= set(active):
                raise ValueError(f"after_round: {sorted(keep - set(active))} did not run in round {round_index}")
            active = [name for name in active if name in keep]
    return samples, labels


def _cuda_window(step: StepRunner, first: int, count: int, device: torch.device) -> list[float]:
    """Time ``count`` steps with CUDA events; one host sync at the end of the window."""
    stream = torch.cuda.current_stream(device)
    # One event per step boundary: the end of step k is the start of step k+1, so the samples
    # tile the device timeline of the window (loop overhead between steps lands in the next
    # step, as it would in a real training loop) and half as many events are recorded.
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
    marks[0].record(stream)
    for k in range(count):
        step(first + k)
        marks[k + 1].record(stream)
    marks[-1].synchronize()
    return [marks[k].elapsed_time(marks[k + 1]) / 1000.0 for k in range(count)]


def _cpu_window(step: StepRunner, first: int, count: int, device: torch.device) -> list[float]:
    """Time ``count`` steps with the host clock; CPU ops finish before they return."""
    times = []
    for k in range(count):
        start = time.perf_counter()
        step(first + k)
        times.append(time.perf_counter() - start)
    return times


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_count(field: str, value: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field}: {value!r} must be an integer >= {minimum}")
