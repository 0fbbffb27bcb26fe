"""``erase-tune start``: set up (or resume) a job, run its loop, confirm its front.

Set-up order is chosen so that a mistake costs nothing: the space file and the workload
are checked first (one probe forward on the CPU, before any trial runs), then Ray is
started or joined (an unreachable cluster leaves the storage untouched), then the storage
is opened and the study created or resumed under the study's lock. A resumed job replays
the local journal of outcomes a previous driver measured but could not store.

Before the first trial a *preflight* runs once per job on a worker: on GPU slots the whole-step
CUDA-graph reference is tried (:func:`erase_tune.measure.trial.reference_capture_error`), and the
baseline's step time is measured (erase_tune.measure.estimate), so the job prints what each phase will
cost before it spends anything, and keeps the figure current as trials finish. Both are kept on
the study (a resumed job does not try again). With ``--time-budget`` the whole job, confirmation
included, ends on time: no trial is started that would run past the budget less the
confirmation's share, and the confirmation's windows are capped to what is left.

The noise floor of the NE gap (erase_tune.measure.noise) is measured only when the space can propose a
cut, and only when the first plan with cuts is about to run (once per study: a resumed job
reuses the stored one); exact plans never need it. A model whose step cannot be captured whole is tuned
without that reference: trials leave it out and record why, a ``whole_step_graph: true``
choice is dropped, and a space that needs it (``gain_over: graph``, only ``whole_step_graph:
true``) is refused with the capture error before any trial runs.

Resume policy: ``--trials N`` is the number of measured trials the *study* should hold, so
re-running the same command resumes; a study tuning another workload or measuring against
another baseline is refused (its trials would not be comparable). Each driver that starts
on a study gets its own sampler seed (base seed + its order of arrival), so two drivers
never propose the same sequence of plans.

The job changes nothing process-wide: what the process it runs in must do (put the shipped
code on the import path, put a SIGTERM handler back after ``ray.init``) is asked of the caller
through :class:`DriverHooks`, which ``erase-tune start`` fills in (cli.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from erase_tune._files import name_problem
from erase_tune.errors import EraseTuneError, shown
from erase_tune.measure.records import MAX_CONFIRM_WINDOWS
from erase_tune.measure.estimate import StepCost, describe_phases, duration, trial_seconds
from erase_tune.measure.noise import quality_trainings
from erase_tune.store import default_storage_url
from erase_tune.store.storage import Storage, open_storage, reach_storage
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.screen import Screen
from erase_tune.tune.execute.executor import RayExecutor, import_dirs, runtime_env
from erase_tune.tune.run.confirm import (
    MAX_CONFIRMED,
    MIN_CONFIRM_WINDOWS,
    Choice,
    choose,
    confirm_front,
    confirm_quality_front,
    with_quality,
)
from erase_tune.tune.run import check
from erase_tune.tune.run.journal import Journal, check_journal
from erase_tune.tune.run.loop import HEARTBEAT_S, Loop, LoopBooks, LoopSpace, Progress
from erase_tune.tune.run.record import Recorder
from erase_tune.tune.search.space import MAX_TRIALS, SearchSpace
from erase_tune.tune.search.study import (
    Attr,
    FrontPoint,
    finalists,
    make_sampler,
    noise_band,
    open_study,
    pareto_front,
)
from erase_tune.tune.execute.task import ConfirmSpec, ReferenceSpec
from erase_tune.workloads import module_of

__all__ = ["JobSpec", "Where", "Patience", "DriverHooks", "JobSummary", "start_job", "JobFailed"]

log = logging.getLogger("erase_tune")

MAX_WAIT_S = 7 * 24 * 3600
"""Longest --gpu-wait and --grace-period: a week."""


class JobFailed(EraseTuneError):
    """The job ran but ended without what it was asked for (every trial failed, too many failed)."""

    exit_code = 1


def _nothing(*args: Any) -> None:
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriverHooks:
    """What :func:`start_job` leaves to the program it runs in: changes to the process itself,
    which a library does not make (``erase-tune start`` supplies them, in cli.py)."""

    import_from: Callable[[Sequence[str]], None] = _nothing
    """Called with the directories the code shipped to the workers (``working_dir``,
    ``py_modules``) imports from, before the driver imports the workload to check the space.
    Left out, the workload must be importable in this process already."""
    ray_started: Callable[[], None] = _nothing
    """Called once Ray is up in this process (``ray.init`` installs a SIGTERM handler of its own,
    which exits without cancelling the trials or marking the job)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What :func:`start_job` runs, beyond the space file: the study and what it should hold."""

    study_name: str | None = None
    """The study (and job) name; default: the space file's name without its suffix."""
    trials: int | None = None
    """Measured trials the study should hold (every driver's count); default: the space's ``trials``."""
    confirm_windows: int = 5
    """Windows of the speed confirmation of the front at the end; 0: no confirmation."""
    quality_scale: int | None = None
    """Overrides the space's ``budget.quality_scale`` for the quality confirmation at the end."""
    quality_seeds: int | None = None
    """Overrides the space's ``budget.quality_seeds``."""
    time_budget_s: float | None = None
    """Seconds the whole job may take, confirmation included; None: no limit."""

    def __post_init__(self) -> None:
        if self.trials == 0:  # a dry run is its own command: it trains nothing and opens no storage
            raise EraseTuneError("--trials: 0 runs no trial and would only set a study up; for a dry run that "
                                 "trains nothing, use: erase-tune check --space FILE")
        if self.trials is not None and not 1 <= self.trials <= MAX_TRIALS:
            raise EraseTuneError(f"--trials: {self.trials} must be in 1..{MAX_TRIALS}")
        if self.time_budget_s is not None and not 1 <= self.time_budget_s <= MAX_WAIT_S:  # also refuses nan
            raise EraseTuneError(f"--time-budget: {self.time_budget_s} must be in 1s..7d")
        w = self.confirm_windows
        if isinstance(w, bool) or not isinstance(w, int) or (w != 0 and not MIN_CONFIRM_WINDOWS <= w
                                                             <= MAX_CONFIRM_WINDOWS):  # before any trial
            raise EraseTuneError(f"--repeats: {shown(self.confirm_windows)} must be an integer in "
                                 f"{MIN_CONFIRM_WINDOWS}..{MAX_CONFIRM_WINDOWS} (an interval needs two windows)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Where:
    """Where the job runs: its storage and its Ray cluster."""

    storage: str | None = None
    """A SQLAlchemy URL; default: ``$ERASE_TUNE_STORAGE``, else ``sqlite:///erase-tune.db``."""
    ray_address: str | None = None
    """Default: ``$RAY_ADDRESS``, else a private local Ray."""
    slots: int | None = None
    """Trials in flight; default: one per GPU, else one per CPU."""
    working_dir: str | None = None
    """Shipped to the workers (Ray's runtime_env); default: the space's ``working_dir``."""
    py_modules: tuple[str, ...] = ()
    """Shipped to the workers too, after the space's ``py_modules``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "py_modules", tuple(self.py_modules))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Patience:
    """How long the job waits: for GPUs to appear, and before another driver's trial is stale."""

    gpu_wait_s: float = 600.0
    """Seconds to wait for GPU trial slots before giving up."""
    grace_period_s: int = 60
    """Seconds without a heartbeat after which a running trial is failed as stale."""

    def __post_init__(self) -> None:
        if not 2 * HEARTBEAT_S <= self.grace_period_s <= MAX_WAIT_S:
            raise EraseTuneError(f"--grace-period: {self.grace_period_s} must be in {2 * HEARTBEAT_S}..{MAX_WAIT_S} "
                                 "seconds (at least two heartbeats, at most a week)")
        if not 0 <= self.gpu_wait_s <= MAX_WAIT_S:  # also refuses nan
            raise EraseTuneError(f"--gpu-wait: {self.gpu_wait_s} must be in 0..{MAX_WAIT_S} seconds (at most a week)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSummary:
    study_name: str
    storage: str
    executor: str
    complete: int
    failed: int
    stopped: str | None
    """Why the job ended early, or None."""
    front: list[FrontPoint]
    """Pareto front within the job's NE budget, best gain first."""
    confirmed: dict[int, tuple[float, float, float]]
    """Trial number → (gain, lo, hi) of the confirmation made at the end."""
    overhead: dict[str, float]
    quality: dict[int, tuple[float, float, float]] = dataclasses.field(default_factory=dict)
    """Trial number → (NE gap, lo, hi) of the quality confirmation made at the end."""
    noise_band: float = 0.0
    """The study's noise floor band of the NE gap."""
    chosen: int | None = None
    """The trial ``export`` would write (:func:`erase_tune.tune.run.confirm.choose`), or None."""
    refusal: str | None = None
    """Why ``export`` would write nothing, or None."""
    estimate: str | None = None
    """What the job estimated before trial 0, one line per phase."""


def start_job(
    space_path: str | Path,
    *,
    what: JobSpec = JobSpec(),
    where: Where = Where(),
    patience: Patience = Patience(),
    on_progress: Callable[[Progress], None] = lambda p: None,
    driver: DriverHooks = DriverHooks(),
) -> JobSummary:
    """Run (or resume) a tuning job; see the module docstring. The arguments were checked when
    they were made (:class:`JobSpec`, :class:`Where`, :class:`Patience`). ``driver``: what the job
    asks of the process it runs in (``erase-tune start`` changes the process there)."""
    began = time.monotonic()
    # Absolute, and now, before Ray starts: export re-reads the space's relative py_modules against
    # its directory, from anywhere; and a Ray job's working directory may be gone once Ray has started.
    space_abspath = os.path.abspath(space_path)
    space = with_quality(SearchSpace.load(space_path), what.quality_scale, what.quality_seeds)
    module = module_of(space.workload.name)
    name = _study_name(what, space_path)
    url = where.storage if where.storage is not None else default_storage_url()
    reach_storage(url)  # a malformed URL, or a server that does not answer, is refused before Ray starts
    check_journal()  # and a journal with nowhere to write
    target = what.trials if what.trials is not None else space.trials  # the space file checks its own
    env = runtime_env(where.working_dir or space.workload.working_dir, [*space.workload.py_modules, *where.py_modules])
    driver.import_from(import_dirs(env))  # the driver imports the workload too (to check the space)
    checked = check_space(space)

    executor = RayExecutor(where.ray_address, workload=space.workload.name, slots=where.slots, device=space.device,
                           gpus_per_trial=space.gpus_per_trial, runtime_env=env, gpu_wait_s=patience.gpu_wait_s,
                           on_ray_started=driver.ray_started)
    executor.cap_slots(target)
    try:
        if space.gain_over == "graph" and executor.device != "cuda":
            raise EraseTuneError(f"{space.source}: gain_over: graph needs GPU trial slots, and this Ray cluster has "
                                 "none (use gain_over: eager, or a cluster with GPUs, or device: cuda to wait for them)")
        executor.wait_ready()
        db = open_storage(url, heartbeat_interval=HEARTBEAT_S, grace_period=patience.grace_period_s)
        try:
            job = _Job(db=db, name=name, space_path=space_abspath, target=target, executor=executor)
            _create_job(job, space)
            # The first line of a job that runs (a refusal before this point is its one error line).
            log.info("workload %s: code from module %s runs here and on the workers (a space file is trusted like "
                     "a script)", space.workload.name, module)
            space, loop, cost = _prepare_loop(job, space, checked, on_progress)
            estimate = _estimate(space, cost, target, loop, what)
            if estimate is not None:
                log.info("estimate: %s", estimate)
            if what.time_budget_s is not None:
                _set_deadline(loop, space, cost, began + what.time_budget_s, what.confirm_windows)
            summary = dataclasses.replace(_run(db, loop, space, name, executor, what.confirm_windows, cost),
                                          estimate=estimate)
        finally:
            db.close()
    finally:
        executor.close()
    return summary


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Job:
    """What every step of a job's set-up works on: its storage, study, space file (absolute),
    trial target and executor."""

    db: Storage
    name: str
    space_path: str
    target: int
    executor: RayExecutor


def _study_name(what: JobSpec, space_path: str | Path) -> str:
    """The study's name (``--study``, else the space file's stem), checked."""
    name = what.study_name if what.study_name is not None else Path(space_path).stem
    if not name.strip():
        raise EraseTuneError("--study: the study name must not be empty")
    if problem := name_problem(name):  # status/export must be able to type it back
        raise EraseTuneError(f"--study: the study name {shown(name)} {problem}")
    return name


def _create_job(job: _Job, space: SearchSpace) -> None:
    """The job's row, running, made before the minutes of set-up (so that a job stopped during
    them is marked as such, like one stopped in its loop); a study of another workload is
    refused before anything runs."""
    db, name, target = job.db, job.name, job.target
    with db.lock(f"study:{name}"):
        _check_resumable(open_study(db, name), space, name)
        db.store.create_job(study_name=name, space_path=job.space_path, space_yaml=space.text,
                            workload=space.workload.name, settings={"trials": target}, n_trials_target=target,
                            get_or_create=True)
        db.store.set_job_status(name, "running", n_trials_target=target)


def _prepare_loop(job: _Job, space: SearchSpace, checked: BoundSpace,
                  on_progress: Callable[[Progress], None]) -> tuple[SearchSpace, Loop, StepCost | None]:
    """The preflight (the graph reference tried, the step's cost measured), the study's noise
    floor and the trial loop set up: the space as the preflight narrowed it, the loop and the
    cost. A failure before the loop exists marks the job stopped."""
    db, name = job.db, job.name
    try:
        original = space
        space, reference_error, cost = _preflight(db, space, name, job.executor)
        if reference_error is not None:
            dropped = "; its whole_step_graph: true choice is dropped" if True in original.cuts.whole_step_graph else ""
            log.info("whole-step CUDA graph: this model's step cannot be captured whole (%s): trials run "
                     "without the graph reference%s", reference_error, dropped)
        with db.lock(f"study:{name}"):
            floor = open_study(db, name).user_attrs.get(Attr.NOISE_FLOOR)
        band = float(floor["band"]) if floor else 0.0
        loop = _set_up(job, space, checked, on_progress, reference_error, band)
    except BaseException as e:
        _mark_stopped(db, name, e)
        raise
    if floor and db.store.noise_floor(loop.recorder.job) is None:
        # A resume after a driver stopped between storing the attr and the row.
        db.store.record_noise_floor(loop.recorder.job, floor)
    if floor:
        log.info("noise floor of the NE gap: ±%.3f%% (a gap above the budget by less is not infeasible)", 100 * band)
    elif space.may_detach and space.budget.per_trial.noise_repeats:
        loop.floor_due = lambda: _lazy_floor(db, space, name, job.executor, loop, cost)
    return space, loop, cost


def _set_deadline(loop: Loop, space: SearchSpace, cost: StepCost | None, deadline: float,
                  confirm_windows: int | None) -> None:
    """The loop's time budget: its deadline, the time kept for the confirmation and, where the
    step's cost is known, what the first trial is expected to take."""
    loop.deadline = deadline
    loop.reserve_s = _confirm_reserve(space, cost, confirm_windows)
    if cost is not None:
        b = space.budget.per_trial
        loop.first_trial_s = trial_seconds(cost, variants=3, warmup_steps=b.warmup_steps,
                                           window_steps=b.window_steps, windows=b.max_windows,
                                           ne_steps=2 * b.quality_steps)


def _mark_stopped(db: Storage, name: str, e: BaseException) -> None:
    """The job ended by ``e``: interrupted (Ctrl-C, SIGTERM), else failed, with its one line."""
    interrupted = isinstance(e, KeyboardInterrupt)
    try:
        with db.once():  # the storage itself may be what failed: not waited for again
            db.store.set_job_status(name, "interrupted" if interrupted else "failed",
                                    error=" ".join(str(e).split()) or type(e).__name__)
    except Exception:  # noqa: BLE001 - the storage itself may be what failed
        pass


def _check_resumable(study: Any, space: SearchSpace, name: str) -> None:
    """A study tuning another workload, or measuring against another baseline, is refused."""
    tuned, over = study.user_attrs.get(Attr.WORKLOAD), study.user_attrs.get(Attr.GAIN_OVER)
    if tuned is not None and tuned != _workload_attr(space):
        raise EraseTuneError(f"study {shown(name)} tunes workload {tuned['name']} with other arguments than "
                             f"{space.source}: use another study name")
    if over is not None and over != space.gain_over:
        raise EraseTuneError(f"study {shown(name)} measures qps_gain over the {over} baseline; {space.source} says "
                             f"{space.gain_over}: use another study name")


def _workload_attr(space: SearchSpace) -> dict[str, Any]:
    """The study's ``workload`` attribute for ``space``: its name and arguments, as stored (a
    study resumed by another space must have the same)."""
    return {"name": space.workload.name, "args": dict(space.workload.args)}


def _noise_floor(db: Storage, space: SearchSpace, name: str, executor: RayExecutor,
                 cost: StepCost | None = None) -> tuple[dict[str, Any] | None, bool]:
    """The study's noise floor (erase_tune.measure.noise): the stored one on resume, else measured now
    on a trial slot (once per study: a driver that finds one stored meanwhile takes that one).
    Returns (floor dict or None when ``noise_repeats`` is 0, whether it was measured here)."""
    with db.lock(f"study:{name}"):
        study = open_study(db, name)
        _check_resumable(study, space, name)
        stored = study.user_attrs.get(Attr.NOISE_FLOOR)
    b = space.budget.per_trial
    if stored is not None or not b.noise_repeats:
        return stored, False
    log.info("noise floor: training the baseline against itself (%d data orders%s): the first plan with cuts needs it",
             b.noise_repeats, ", and the whole-step graph" if executor.device == "cuda" else "")
    spec = ConfirmSpec(workload=space.workload.name, workload_args=dict(space.workload.args), plans={},
                       budget=dataclasses.asdict(b), windows=0, gain_over=space.gain_over, task="noise")
    runs = b.noise_repeats + 1  # the data orders, and the whole-step graph
    expected = None if cost is None else runs * cost.run_s(b.training_steps)
    outcome = executor.confirm(spec, timeout=float(space.budget.timeout_s) * (b.noise_repeats + 2),
                               expected_s=expected)
    if outcome.result is None:
        raise JobFailed(f"job {name}: the noise floor of the NE gap could not be measured (the baseline trained "
                        f"alone failed): {outcome.failure.reason}")
    floor = outcome.result.to_dict()
    with db.lock(f"study:{name}"):
        if study.user_attrs.get(Attr.NOISE_FLOOR) is not None:  # another driver measured it meanwhile
            return study.user_attrs[Attr.NOISE_FLOOR], False
        study.set_user_attr(Attr.NOISE_FLOOR, floor)
        study.set_user_attr(Attr.NOISE_BAND, floor["band"])
    return floor, True




def _preflight(db: Storage, space: SearchSpace, name: str,
               executor: RayExecutor) -> tuple[SearchSpace, str | None, StepCost | None]:
    """Once per job, on a worker (see the module docstring): the space to run (``whole_step_graph``
    limited to false and the reference off when the step cannot be captured whole), why it
    cannot (or None), and the baseline's step cost (None when it could not be measured)."""
    study = open_study(db, name)
    tuned = study.user_attrs.get(Attr.WORKLOAD)
    if tuned is not None and tuned != _workload_attr(space):
        return space, None, None  # another workload's study: _set_up refuses it
    try_graph = executor.device == "cuda" and space.budget.per_trial.reference
    known = Attr.REFERENCE_ERROR in study.user_attrs
    stored = study.user_attrs.get(Attr.STEP_COST)
    error = study.user_attrs.get(Attr.REFERENCE_ERROR) if known else None
    if (try_graph and not known) or stored is None:
        spec = ReferenceSpec(workload=space.workload.name, workload_args=dict(space.workload.args),
                             seed=space.budget.per_trial.seed, try_graph=try_graph and not known)
        outcome = executor.reference(spec, timeout=space.budget.timeout_s)
        if outcome.failure is not None and outcome.failure.kind == "infra":
            raise JobFailed(f"job {name}: could not run the preflight on a worker: {outcome.failure.reason}")
        if try_graph and not known:
            error = outcome.reason
            study.set_user_attr(Attr.REFERENCE_ERROR, error)
        elif outcome.failure is not None:  # the workload's own error: its trials say it again
            log.warning("preflight: the baseline's step time could not be measured (%s)", outcome.failure.reason)
        if outcome.step is not None:
            stored = dict(outcome.step)
            study.set_user_attr(Attr.STEP_COST, stored)
    cost = StepCost(**stored) if isinstance(stored, dict) else None
    if not try_graph or error is None:
        return space, None, cost
    if space.gain_over == "graph":
        raise EraseTuneError(f"{space.source}: gain_over: graph, but this model's step cannot be captured as one CUDA "
                             f"graph ({error}); use gain_over: eager")
    if False not in space.cuts.whole_step_graph:
        raise EraseTuneError(f"{space.source}: cuts.whole_step_graph: [true], but this model's step cannot be captured "
                             f"as one CUDA graph ({error}); use [false]")
    narrowed = dataclasses.replace(space.with_budget(reference=False),
                                   cuts=dataclasses.replace(space.cuts, whole_step_graph=(False,)))
    return narrowed, error, cost


def _lazy_floor(db: Storage, space: SearchSpace, name: str, executor: RayExecutor, loop: Loop,
                cost: StepCost | None = None) -> float:
    """The noise floor, measured now (the first plan with cuts is about to run) or taken from
    another driver that measured it; stored in the job's tables too. Returns its band."""
    floor, measured_here = _noise_floor(db, space, name, executor, cost)
    if floor is None:
        return 0.0
    if measured_here or db.store.noise_floor(loop.recorder.job) is None:
        db.store.record_noise_floor(loop.recorder.job, floor)
    band = float(floor["band"])
    log.info("noise floor of the NE gap: ±%.3f%% (a gap above the budget by less is not infeasible)", 100 * band)
    return band


def _estimate(space: SearchSpace, cost: StepCost | None, target: int, loop: Loop, what: JobSpec) -> str | None:
    """The phases of this job and their durations, one line (erase_tune.measure.estimate); None without a step cost."""
    if cost is None:
        return None
    left = max(0, target - loop.counts()[0])
    phases = check.phases(space, cost, left=left,
                          singles=len(loop.screen.singles) if loop.screen is not None else None,
                          cuda=loop.executor.device == "cuda", slots=max(1, loop.executor.slots),
                          noise_due=loop.floor_due is not None, confirm_windows=what.confirm_windows)
    return f"{describe_phases(phases)} (from a measured step of {cost.step_s * 1e3:.1f} ms)"


def _confirm_reserve(space: SearchSpace, cost: StepCost | None, windows: int) -> float:
    """Seconds a time budget keeps for the confirmation at its least (its minimum of windows)."""
    if cost is None or not windows:
        return 0.0
    b = space.budget.per_trial
    return (MAX_CONFIRMED + 1) * cost.run_s(b.warmup_steps + windows * b.window_steps)


def _quality_seconds(space: SearchSpace, cost: StepCost | None, points: list[FrontPoint]) -> float:
    """What the quality confirmation of ``points`` costs: the plans not verified exact and the
    baseline, each trained ``quality_scale`` times a trial's steps per seed (the baseline's
    trainings the noise floor did are not repeated)."""
    b = space.budget.per_trial
    trained = [p for p in points if not p.user_attrs.get(Attr.EXACT)]
    if cost is None or not trained or not b.quality_scale:
        return 0.0
    return quality_trainings(len(trained), b, floor=bool(b.noise_repeats)) * cost.run_s(
        b.quality_scale * b.training_steps)


def _confirm_windows(space: SearchSpace, cost: StepCost | None, windows: int, seconds_left: float | None) -> int:
    """The confirmation's cap of windows: the space's ``budget.confirm_max_windows``, or what the time left allows."""
    cap = max(windows, space.budget.confirm_max_windows)
    if seconds_left is None or cost is None:
        return cap
    b = space.budget.per_trial
    runners = MAX_CONFIRMED + 1
    per_window = runners * b.window_steps * cost.step_s
    spare = seconds_left - runners * cost.run_s(b.warmup_steps)
    return max(windows, min(cap, int(spare / per_window) if per_window > 0 else cap))


def _set_up(job: _Job, space: SearchSpace, checked: BoundSpace, on_progress: Callable[[Progress], None],
            reference_error: str | None = None, band: float = 0.0) -> Loop:
    db, name, target, executor = job.db, job.name, job.target, job.executor
    checked = checked.rebind(space)  # the space as narrowed by the graph reference
    with db.lock(f"study:{name}"):
        study = open_study(db, name)
        _check_resumable(study, space, name)
        drivers = int(study.user_attrs.get(Attr.DRIVERS, 0))
        for key, value in ((Attr.WORKLOAD, _workload_attr(space)), (Attr.MAX_NE_GAP, space.max_ne_gap),
                           (Attr.GAIN_OVER, space.gain_over), (Attr.DRIVERS, drivers + 1)):
            study.set_user_attr(key, value)
        if not study.get_trials(deepcopy=False):
            for seed_name, params in checked.seeds:
                study.enqueue_trial(params, user_attrs={Attr.SEED_NAME: seed_name})
        db.store.create_job(study_name=name, space_path=job.space_path, space_yaml=space.text,
                            workload=space.workload.name, settings={"trials": target}, n_trials_target=target,
                            get_or_create=True)
        row = db.store.set_job_status(name, "running", n_trials_target=target)
        seed = None if space.sampler.seed is None else space.sampler.seed + 1_000_003 * drivers
        study.sampler = make_sampler(space.sampler.name, seed, max_ne_gap=space.max_ne_gap + band,
                                     plan_key=checked.key)
        recorder = Recorder(study=study, storage=db, job=row, space=space)
        recorder.band = band
        journal = Journal(db.url, name)
        for entry in journal.entries():  # outcomes a driver measured but could not store
            recorder.record(entry.trial_number, entry.plan_key, entry.outcome, entry.attempts)
            journal.remove(entry.trial_number)
    return Loop(what=LoopSpace(space=space, checked=checked, screen=Screen(checked) if space.sampler.screen else None,
                               reference_error=reference_error),
                books=LoopBooks(study=study, storage=db, recorder=recorder, journal=journal),
                executor=executor, target=target, max_failures=max(3, target), on_progress=on_progress)


def _run(db: Storage, loop: Loop, space: SearchSpace, name: str, executor: RayExecutor,
         confirm_windows: int, cost: StepCost | None = None) -> JobSummary:
    try:
        loop.run()
    except BaseException as e:
        _mark_stopped(db, name, e)  # the storage first: Ray may be what stopped with this driver
        loop.abort("interrupted" if isinstance(e, KeyboardInterrupt) else f"driver stopped: {e}")
        raise
    try:
        return _after_trials(db, loop, space, name, executor, confirm_windows, cost)
    except JobFailed:
        raise
    except BaseException as e:  # Ctrl-C or SIGTERM during the confirmation: the job says so too
        _mark_stopped(db, name, e)
        raise


def _after_trials(db: Storage, loop: Loop, space: SearchSpace, name: str, executor: RayExecutor,
                  confirm_windows: int, cost: StepCost | None) -> JobSummary:
    """Confirm the front (speed, then quality) and end the job with its summary."""
    complete, failed = loop.counts()
    front = pareto_front(loop.study, space.max_ne_gap)
    final = finalists(loop.study, space.max_ne_gap, MAX_CONFIRMED)
    confirmed, quality = {}, {}
    choice: Choice | None = None
    if confirm_windows and final:
        cap = _confirm_windows(space, cost, confirm_windows, loop.seconds_left())
        confirmed = confirm_front(db, loop.study, space, executor, final, windows=confirm_windows, max_windows=cap,
                                  expected_s=_confirm_reserve(space, cost, cap) or None)
        proven = [p for p in final if p.number in confirmed and confirmed[p.number][1] > 0]
        need = _quality_seconds(space, cost, proven)
        left = loop.seconds_left()
        if need and left is not None and need > left:
            log.info("quality confirmation left out: it needs about %s and the time budget has %s left; plans with "
                     "cuts are not exported unless export confirms them (--quality-scale)", duration(need),
                     duration(max(0.0, left)))
            loop.study.set_user_attr(Attr.QUALITY_LEFT_OUT, True)
        else:
            try:
                quality = {n: (q.ne_gap, q.ne_gap_lo, q.ne_gap_hi)  # (exact plans were not trained)
                           for n, q in confirm_quality_front(db, loop.study, space, executor, proven,
                                                             expected_s=need or None).items()
                           if not q.exact}
            except EraseTuneError as e:  # the trials are stored: export confirms quality again
                log.warning("%s (export will try again)", e)
        job = db.store.get_job(name)
        if job is not None:  # what export will write, by the same rule (so the two agree)
            stored = {c.trial_number: c for c in db.store.confirmations(job)}
            stored_q = {q.trial_number: q for q in db.store.quality_confirmations(job)}
            choice = choose(final, stored, stored_q, max_ne_gap=space.max_ne_gap, band=noise_band(loop.study),
                            gain_over=space.gain_over, quality_required=bool(space.budget.per_trial.quality_scale))
    stopped = loop.stopped
    if complete == 0 or (stopped is not None and complete < loop.target and failed >= loop.max_failures):
        db.store.set_job_status(name, "failed", error=stopped or "every trial failed")
        raise JobFailed(f"job {name}: {complete} trials measured, {failed} failed: {stopped or 'every trial failed'}"
                        f" (see: erase-tune status --study {name} --storage '{db.url}')")
    db.store.set_job_status(name, "finished")
    return JobSummary(study_name=name, storage=db.url, executor=executor.describe, complete=complete,
                      failed=failed, stopped=stopped, front=front, confirmed=confirmed, overhead=loop.overhead(),
                      quality=quality, noise_band=noise_band(loop.study),
                      chosen=choice.point.number if choice is not None and choice.refusal is None else None,
                      refusal=choice.refusal if choice is not None else None)
