"""How long a tuning job will take, from step times measured on the trial device.

A job is phases run one after another: the structural screen, the sampler's search, the noise
floor of the NE gap (only when the space can detach something), the speed confirmation of the
front, its quality confirmation (again only for plans with cuts) and the export. Each costs a
number of training steps that follows from the budget (warm-up, windows of the interleaved
protocol, NE training), times the step time, plus building each variant's model. Both are
measured once per job on a trial worker (:func:`measure_step`), before trial 0, so ``start`` can
say what the job will cost before it spends anything, and keep the figure current as trials
finish (their own durations replace the model).

Windows are sequential (a trial stops once its interval is narrow), so a phase is a range:
``low`` with every plan stopping at the minimum of windows, ``high`` at the cap. Pure
arithmetic apart from :func:`measure_step`; no Optuna, Ray or SQL.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the phases' arithmetic needs no torch: the executor and export import it
    import torch

    from erase_tune.workloads import Workload

__all__ = ["StepCost", "Phase", "TrialShape", "JobShape", "measure_step", "trial_seconds", "job_phases",
           "describe_phases", "duration", "phase_limit", "PHASE_LIMIT_FACTOR", "PHASE_LIMIT_FLOOR_S"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCost:
    """What one variant of a trial costs on the trial device."""

    step_s: float
    """Median seconds of one eager training step of the baseline (device-synchronised)."""
    build_s: float
    """Seconds to copy the model to the device and wrap it in an engine (once per variant)."""

    def __post_init__(self) -> None:
        for name in ("step_s", "build_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and value == value and value != float("inf")):
                raise ValueError(f"StepCost.{name}: {value!r} must be a finite number of seconds >= 0")

    def run_s(self, steps: int) -> float:
        """One model built and trained ``steps`` steps."""
        return self.build_s + steps * self.step_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phase:
    """One phase of a job and its estimated duration."""

    name: str
    what: str
    """What it runs, in a few words (``6 plans``, ``3 plans, 5..40 windows``)."""
    low_s: float
    high_s: float


def measure_step(workload: Workload, device: str | torch.device | None = None, *, steps: int = 5,
                 warmup: int = 3) -> StepCost:
    """Time the workload's baseline (an engine with the empty plan) for ``steps`` steps after
    ``warmup`` on one example batch (:meth:`Workload.example`: no data pool is built), synchronising
    the device after each (an estimate, not a measurement users act on: the per-step sync hides
    pipelining, which makes it err long)."""
    import torch

    from erase_tune.runtime import EraseEngine, ErasePlan
    from erase_tune.runtime.device import resolve_device

    device = resolve_device(device)
    batch = workload.example(device)
    init = workload.build_model()
    started = time.perf_counter()
    engine = EraseEngine(copy.deepcopy(init).to(device), ErasePlan(), loss_fn=workload.loss_fn,
                         optimizer=workload.optimizer, example=batch, make_head=workload.make_head,
                         output=workload.output, model_loss=workload.model_loss)
    build_s = time.perf_counter() - started
    times = []
    try:
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            engine.step(*batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    times.sort()
    return StepCost(step_s=times[len(times) // 2], build_s=build_s)


def trial_seconds(cost: StepCost, *, variants: int, warmup_steps: int, window_steps: int, windows: int,
                  ne_steps: int = 0) -> float:
    """One trial: ``variants`` models built, warmed up and timed for ``windows`` windows each, then
    ``ne_steps`` training steps for NE (0 for an exact plan)."""
    return variants * cost.run_s(warmup_steps + windows * window_steps) + ne_steps * cost.step_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialShape:
    """What one trial of the job runs: its budget's steps and windows, whether it also times the
    whole-step graph (``reference``) and whether the space can cut (``may_detach``: then a trial
    may train for NE and time the detach-only twin)."""

    warmup_steps: int
    window_steps: int
    min_windows: int
    max_windows: int
    quality_steps: int
    training_steps: int
    reference: bool
    may_detach: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobShape:
    """How many of each phase's runs the job has: ``screen_plans`` (exact or single-cut plans,
    measured like any trial), ``search_trials``, ``noise_runs`` and ``quality_runs`` (trainings of
    the trial's training steps, the quality runs already scaled), and the confirmation's plans
    and windows."""

    screen_plans: int
    search_trials: int
    noise_runs: int
    confirm_plans: int
    confirm_min_windows: int
    confirm_max_windows: int
    quality_runs: int


def job_phases(cost: StepCost, trial: TrialShape, job: JobShape) -> list[Phase]:
    """The phases of a job (module docstring)."""
    t, j = trial, job
    variants = 2 + int(t.reference)  # baseline, candidate (and the graph reference)
    most = variants + 1 if t.may_detach else variants  # a cut adds the detach-only twin ...
    ne = 2 * t.quality_steps if t.may_detach else 0  # ... and NE training: candidate and, at worst, the baseline

    def window_steps(windows: int) -> int:
        return t.warmup_steps + windows * t.window_steps

    def training() -> float:
        return cost.run_s(t.training_steps)

    phases = []
    for name, n, what in (("screen", j.screen_plans, "plans"), ("search", j.search_trials, "trials")):
        if n:
            low = n * trial_seconds(cost, variants=variants, warmup_steps=t.warmup_steps,
                                    window_steps=t.window_steps, windows=t.min_windows)
            high = n * trial_seconds(cost, variants=most, warmup_steps=t.warmup_steps, window_steps=t.window_steps,
                                     windows=t.max_windows, ne_steps=ne)
            phases.append(Phase(name=name, what=f"{n} {what}", low_s=low, high_s=high))
    if t.may_detach and j.noise_runs:
        s = j.noise_runs * training()
        phases.append(Phase(name="noise floor", what=f"{j.noise_runs} trainings (when the first cut is proposed)",
                            low_s=s, high_s=s))
    if j.confirm_plans:
        runners = j.confirm_plans + 1
        low = runners * cost.run_s(window_steps(j.confirm_min_windows))
        high = runners * cost.run_s(window_steps(j.confirm_max_windows))
        phases.append(Phase(name="confirmation", what=f"{j.confirm_plans} plans, {j.confirm_min_windows}.."
                                                      f"{j.confirm_max_windows} windows", low_s=low, high_s=high))
        if t.may_detach and j.quality_runs:
            phases.append(Phase(name="quality", what=f"up to {j.quality_runs} trainings (plans with cuts only)",
                                low_s=0.0, high_s=j.quality_runs * training()))
    phases.append(Phase(name="export", what="the confirmed plan, written", low_s=0.0, high_s=0.0))
    return phases


PHASE_LIMIT_FACTOR = 4.0
"""A phase whose duration is estimated is stopped after this many times the estimate ..."""
PHASE_LIMIT_FLOOR_S = 300.0
"""... and never sooner than this (a worker's start and the model's build vary more than steps do)."""


def phase_limit(expected_s: float | None, safety_s: float) -> float:
    """How long a phase (a confirmation, the noise floor) may run before it is stopped: a few
    times what it is expected to take from the measured step, never more than ``safety_s`` (the
    space's per-trial timeout times the runs, the limit when nothing is estimated). A job of
    minutes announces minutes, not the hours its timeouts add up to."""
    if expected_s is None or not expected_s > 0:
        return safety_s
    return min(safety_s, max(PHASE_LIMIT_FLOOR_S, PHASE_LIMIT_FACTOR * expected_s))


def duration(seconds: float) -> str:
    """``42s``, ``3m20s``, ``1h05m``: a duration as a person reads it."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def describe_phases(phases: Sequence[Phase]) -> str:
    """One line: each phase with its range, and the total."""
    parts = []
    for p in phases:
        span = duration(p.high_s) if round(p.low_s) == round(p.high_s) else f"{duration(p.low_s)}-{duration(p.high_s)}"
        parts.append(f"{p.name} ({p.what}) {span}")
    low, high = sum(p.low_s for p in phases), sum(p.high_s for p in phases)
    return f"{'; '.join(parts)}; total {duration(low)}-{duration(high)}"
