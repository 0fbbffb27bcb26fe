"""What a trial worker runs: a plain, picklable spec in, a typed outcome out.

This is the seam between the service and the library: a Ray actor (or anything else) calls
:func:`run_spec` in its process; it builds the workload, runs
:func:`erase_tune.measure.trial.run_trial` and turns every way a trial can go wrong into a
:class:`~erase_tune.tune.execute.outcome.Failure` of the right kind, so a broken trial is recorded,
not fatal. :func:`run_confirm` does the same for a confirming re-measurement (of speed or of
quality) and for the noise floor a job measures when its first cut is proposed, and
:func:`run_reference` for the job's preflight before its first trial: one try of the
whole-step-graph reference (on CUDA; in a worker the executor replaces afterwards when the
capture failed: a failed capture can leave a process's CUDA state unfit for measuring) and the
baseline's step time, from which the job estimates its phases (erase_tune.measure.estimate).
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from erase_tune.tune.execute.outcome import ConfirmOutcome, Failure, TrialOutcome, WorkerInfo

__all__ = ["TrialSpec", "ConfirmSpec", "ReferenceSpec", "ReferenceOutcome", "run_spec", "run_confirm",
           "run_reference", "classify", "fit_after"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialSpec:
    """Everything a worker needs for one trial; plain data so it pickles across processes."""

    trial_number: int
    workload: str
    workload_args: Mapping[str, Any]
    plan: Mapping[str, Any]
    budget: Mapping[str, Any]
    device: str = "auto"
    baseline_ne: float | None = None
    """The baseline's held-out NE from an earlier trial of this job (saves its training)."""
    reference_error: str | None = None
    """Why the job's whole-step-graph reference cannot be captured (the trial leaves it out and
    records this), or None: it can, or was not tried (CPU, ``budget.reference`` off)."""
    gain_over: str = "eager"
    """The baseline whose gain interval decides when the trial stops measuring."""
    stop_below: float | None = None
    """Racing: the trial stops once its gain's upper bound is below this (the front's best lower bound)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfirmSpec:
    """A confirming re-measurement of front plans (see :mod:`erase_tune.measure.confirm`)."""

    workload: str
    workload_args: Mapping[str, Any]
    plans: Mapping[str, Mapping[str, Any]]
    """Plan dicts by name (the trial number, as a string)."""
    budget: Mapping[str, Any]
    windows: int
    gain_over: str
    device: str = "auto"
    task: str = "speed"
    """``speed`` (:func:`erase_tune.measure.confirm.confirm_plans`), ``quality``
    (:func:`erase_tune.measure.noise.confirm_quality`) or ``noise``
    (:func:`erase_tune.measure.noise.measure_noise_floor`; ``plans`` is then empty)."""
    band: float = 0.0
    """``quality``: the job's noise floor band (the interval of plans exact by construction)."""
    max_windows: int = 40
    """``speed``: windows at most per plan (``windows`` is the least)."""
    exact: tuple[str, ...] | None = None
    """``quality``: the plans a trial verified exact (not trained); None: those exact by construction."""
    halfwidth: float = 0.02
    """``speed``: a plan stops once its gain's 95% interval is within ± this."""
    floor: Mapping[str, Any] | None = None
    """``quality``: the job's noise floor (``NoiseFloor.to_dict()``), whose baseline trainings of
    the same length are reused; None: the baseline is trained on every order."""


CONFIRM_TASKS = ("speed", "quality", "noise")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceSpec:
    """The job's preflight: one try of the whole-step-graph reference
    (:func:`erase_tune.measure.trial.reference_capture_error`, when ``try_graph``) and the baseline's
    step cost (:func:`erase_tune.measure.estimate.measure_step`)."""

    workload: str
    workload_args: Mapping[str, Any]
    seed: int = 0
    device: str = "auto"
    try_graph: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceOutcome:
    """What the try found: ``error`` is the capture's one line (None: it captures); ``failure``
    is anything else that went wrong on the way (the workload's own error, a lost worker)."""

    error: str | None = None
    failure: Failure | None = None
    worker: WorkerInfo = dataclasses.field(default_factory=WorkerInfo)
    step: Mapping[str, float] | None = None
    """The baseline's step cost (``StepCost`` as a dict: ``step_s``, ``build_s``), where measured."""

    @property
    def reason(self) -> str | None:
        """Why the reference cannot be used, in one line; None when it can."""
        return self.failure.reason if self.failure is not None else self.error


def run_spec(spec: TrialSpec, info: Callable[[], dict[str, Any]] = dict, process_group: Any = None) -> TrialOutcome:
    """Run one trial; never raises for a trial's own failure. ``info`` adds where it ran;
    ``process_group``: as one rank of a data-parallel trial (:mod:`erase_tune.tune.execute.distributed`)."""

    def work() -> Any:
        from erase_tune.runtime import ErasePlan
        from erase_tune.measure.trial import Budget, Ranking, run_trial
        from erase_tune.workloads import get_workload

        plan = ErasePlan.from_dict(dict(spec.plan))
        workload = get_workload(spec.workload, dict(spec.workload_args))
        marks["ready"] = time.time()
        return run_trial(workload, plan, Budget(**spec.budget), device=spec.device, baseline_ne=spec.baseline_ne,
                         process_group=process_group, reference_error=spec.reference_error,
                         ranking=Ranking(gain_over=spec.gain_over, stop_below=spec.stop_below))

    marks: dict[str, float] = {}
    result, failure, worker = _run(work, marks, info, fit=fit_after(spec.device, process_group))
    return TrialOutcome(trial_number=spec.trial_number, result=result, failure=failure, worker=worker)


def run_confirm(spec: ConfirmSpec, info: Callable[[], dict[str, Any]] = dict,
                process_group: Any = None) -> ConfirmOutcome:
    """Run one confirmation; never raises for its own failure."""

    def work() -> Any:
        from erase_tune.measure.confirm import ConfirmWindows, confirm_plans
        from erase_tune.runtime import ErasePlan
        from erase_tune.measure.trial import Budget
        from erase_tune.workloads import get_workload

        workload = get_workload(spec.workload, dict(spec.workload_args))
        plans = {name: ErasePlan.from_dict(dict(p)) for name, p in spec.plans.items()}
        marks["ready"] = time.time()
        if spec.task != "speed":
            return _quality_or_noise(spec, workload, plans, process_group)
        timing = ConfirmWindows(windows=spec.windows, max_windows=spec.max_windows, halfwidth=spec.halfwidth)
        return confirm_plans(workload, plans, budget=Budget(**spec.budget), timing=timing, gain_over=spec.gain_over,
                             device=spec.device, process_group=process_group)

    marks: dict[str, float] = {}
    result, failure, worker = _run(work, marks, info, fit=fit_after(spec.device, process_group))
    return ConfirmOutcome(result=result, failure=failure, worker=worker)


def _quality_or_noise(spec: ConfirmSpec, workload: Any, plans: Mapping[str, Any], process_group: Any) -> Any:
    """The ``quality`` and ``noise`` tasks of a :class:`ConfirmSpec` (erase_tune.measure.noise)."""
    from erase_tune.errors import EraseTuneError
    from erase_tune.measure.noise import NoiseFloor, QualitySettings, confirm_quality, measure_noise_floor
    from erase_tune.measure.trial import Budget

    budget = Budget(**spec.budget)
    if spec.task == "noise":
        # The whole-step graph is a perturbation only where the job found it capturable (the
        # service turns budget.reference off when it is not).
        return measure_noise_floor(workload, budget, repeats=budget.noise_repeats, device=spec.device,
                                   graph=None if budget.reference else False, process_group=process_group)
    if spec.task == "quality":
        settings = QualitySettings(scale=budget.quality_scale, seeds=budget.quality_seeds, band=spec.band,
                                   floor=NoiseFloor.from_dict(spec.floor) if spec.floor else None)
        return confirm_quality(workload, plans, budget=budget, settings=settings, device=spec.device,
                               process_group=process_group, exact=spec.exact)
    raise EraseTuneError(f"confirmation task {spec.task!r} is not one of {', '.join(CONFIRM_TASKS)}")


def run_reference(spec: ReferenceSpec, info: Callable[[], dict[str, Any]] = dict) -> ReferenceOutcome:
    """The preflight (:class:`ReferenceSpec`); never raises for the workload's own failure. The
    capture is tried first in the process (see :func:`erase_tune.measure.trial.reference_capture_error`)."""

    def work() -> tuple[str | None, dict[str, float]]:
        from erase_tune.measure.estimate import measure_step
        from erase_tune.measure.trial import reference_capture_error
        from erase_tune.workloads import get_workload

        workload = get_workload(spec.workload, dict(spec.workload_args))
        marks["ready"] = time.time()
        error = reference_capture_error(workload, spec.device, seed=spec.seed) if spec.try_graph else None
        return error, dataclasses.asdict(measure_step(workload, spec.device))

    marks: dict[str, float] = {}
    got, failure, worker = _run(work, marks, info)
    error, step = got if got is not None else (None, None)
    return ReferenceOutcome(error=error, failure=failure, worker=worker, step=step)


def _run(work: Callable[[], T], marks: dict[str, float], info: Callable[[], dict[str, Any]],
         fit: bool = False) -> tuple[T | None, Failure | None, WorkerInfo]:
    """``work``'s result or its failure, and where it ran; ``fit``: the process may run more work
    after a failure of ``work`` (it may after a success)."""
    started = time.time()
    result, failure, reusable = None, None, True
    try:
        result = work()
    except Exception as e:  # noqa: BLE001 - every failure is data for the study
        failure = classify(e, traceback.format_exc(limit=12))
        reusable = failure.kind == "trial" and fit
    finished = time.time()
    worker = WorkerInfo(**{"pid": os.getpid(), **info()}, started_at=started, ready_at=marks.get("ready", finished),
                        finished_at=finished, reusable=reusable)
    return result, failure, worker


def fit_after(device: str, process_group: Any = None) -> bool:
    """Whether a worker whose trial failed may run the slot's next trial in the same process,
    rather than be replaced (a fresh process: 2-5 s of imports and the first optimizer's).

    On the CPU, yes: a failed trial (a plan the runtime refuses, a NaN loss, the workload's own
    error) leaves nothing behind that the next trial's set-up does not build anew. Not on CUDA:
    a failed capture can leave the process's CUDA RNG in capture state, and an out-of-memory
    error or a sticky CUDA error poisons what follows, none of which a check here can rule out.
    Not after a rank of a data-parallel trial failed either: its peers and their collectives
    are in any state."""
    return device == "cpu" and process_group is None


def classify(e: BaseException, tb: str | None = None) -> Failure:
    """A worker's exception as a failure of the right kind, with a one-line reason.

    A package the worker cannot import is the cluster's problem (``infra``: the code did
    not travel to this node); everything else the plan or workload caused is ``trial``.
    """
    import torch

    from erase_tune.errors import EraseTuneError

    text = " ".join(str(e).split())
    if isinstance(e, ImportError) or isinstance(e.__cause__, ImportError):
        missing = getattr(e.__cause__ if isinstance(e.__cause__, ImportError) else e, "name", None)
        hint = f" (the worker cannot import {missing!r}: ship it with --working-dir or --py-module)" if missing else ""
        return Failure(kind="infra", reason=f"{text[:300]}{hint}", traceback=tb)
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return Failure(kind="trial", reason=f"CUDA out of memory: {text[:300]}", traceback=tb)
    if isinstance(e, EraseTuneError):
        return Failure(kind="trial", reason=text or type(e).__name__, traceback=tb)
    return Failure(kind="trial", reason=f"{type(e).__name__}: {text[:300]}", traceback=tb)
