"""The job driver behind ``erase-tune start``: ask → dispatch → tell, until the study is done.

One driver owns one job (= one Optuna study + one row in ``et_jobs``). It asks the study for
plans, hands them to the executor as many at a time as there are slots, and tells each
result to the study as it arrives, recording the measurement (with per-step samples) in
the project's tables. Trials that hang past the space's timeout are cancelled and failed;
a plan the study already measured (same canonical plan) is answered from that trial
without running it again. Optuna's heartbeat only works with ``study.optimize``, so the
driver keeps its own: in-flight trials carry a heartbeat attr, and on (re)start RUNNING
trials whose heartbeat went stale are failed as "stale". ``--trials N`` is the total a
study should hold, so re-running the same command resumes a job where it stopped.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from erase_tune.errors import EraseTuneError
from erase_tune.runtime import Cut, ErasePlan
from erase_tune.store import Store, baseline_key, default_storage_url, redact_url
from erase_tune.tune.executor import RayExecutor, TrialHandle
from erase_tune.tune.space import SearchSpace, plan_params
from erase_tune.tune.study import (
    Attr,
    FrontPoint,
    make_sampler,
    objective_values,
    open_study,
    pareto_front,
    set_ne_constraint,
)
from erase_tune.tune.worker import TrialSpec
from erase_tune.workloads import get_workload

__all__ = ["JobSummary", "Progress", "start_job", "check_space", "STALE_AFTER_S"]

STALE_AFTER_S = 120.0
HEARTBEAT_EVERY_S = 10.0
_FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progress:
    """A snapshot for the live display."""

    event: str
    """``started``, ``trial`` (one finished), ``duplicate``, ``stale`` or ``done``."""
    message: str
    done: int
    failed: int
    running: int
    target: int
    best: FrontPoint | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSummary:
    study_name: str
    storage: str
    executor: str
    complete: int
    failed: int
    front: list[FrontPoint]
    """Pareto front within the job's NE budget, best gain first."""
    overhead: dict[str, float]
    """Mean seconds per trial: driver (ask/tell/db writes), dispatch (Ray submit→start and
    result return), startup (fresh worker process imports), trial; and their fractions."""


def start_job(
    space_path: str | Path,
    *,
    study_name: str | None = None,
    trials: int | None = None,
    storage: str | None = None,
    ray_address: str | None = None,
    slots: int | None = None,
    on_progress: Callable[[Progress], None] = lambda p: None,
) -> JobSummary:
    """Run (or resume) a tuning job; see the module docstring."""
    space = SearchSpace.load(space_path)
    url = storage or default_storage_url()
    name = study_name or Path(space_path).stem
    target = trials if trials is not None else space.trials
    if target < 1:
        raise EraseTuneError(f"--trials: {target} must be >= 1")
    if slots is not None and slots < 1:  # before the job is touched
        raise EraseTuneError(f"--slots: {slots} must be >= 1")

    candidates, seeds = check_space(space)

    store = Store(url)
    store.upgrade()
    study = open_study(url, name, sampler=make_sampler(space.sampler, space.sampler_seed))
    resumed = len(study.get_trials(deepcopy=False))
    if resumed and space.sampler_seed is not None:
        # A fresh sampler with the same seed would replay the first run's proposals, each a
        # repeat of a measured plan: offset the seed by the trials the study already holds.
        study.sampler = make_sampler(space.sampler, space.sampler_seed + resumed)
    previous = study.user_attrs.get(Attr.GAIN_OVER)
    if previous is not None and previous != space.gain_over:
        raise EraseTuneError(f"study {name!r} measures qps_gain over the {previous} baseline; this space says "
                             f"{space.gain_over}: use another study name")
    workload_attr = {"name": space.workload, "args": dict(space.workload_args)}
    tuned = study.user_attrs.get(Attr.WORKLOAD)
    if tuned is not None and tuned != workload_attr:
        # Resuming across workloads would mix incomparable trials (and match repeats across them).
        raise EraseTuneError(f"study {name!r} tunes workload {tuned['name']} with other arguments than "
                             f"{space.source}: use another study name")
    # Ray before the job is touched: a cluster that cannot be reached leaves the job as it was.
    executor = RayExecutor(ray_address, slots=slots, device=space.device)
    try:
        if space.gain_over == "graph" and executor.device != "cuda":
            raise EraseTuneError(f"{space.source}: gain_over: graph needs GPU trial slots, and this Ray cluster has "
                                 "none (use gain_over: eager, or a cluster with GPUs)")
        study.set_user_attr(Attr.WORKLOAD, workload_attr)
        study.set_user_attr(Attr.MAX_NE_GAP, space.max_ne_gap)
        study.set_user_attr(Attr.GAIN_OVER, space.gain_over)
        job = store.create_job(study_name=name, space_path=str(space_path), space_yaml=space.text,
                               workload=space.workload, settings={"storage": redact_url(url), "trials": target},
                               n_trials_target=target, get_or_create=True)
        if job.status != "running" or job.n_trials_target != target:
            job = store.set_job_status(name, "running", n_trials_target=target)
        if not study.trials:
            for seed_name, params in seeds:
                study.enqueue_trial(params, user_attrs={Attr.SEED_NAME: seed_name}, skip_if_exists=True)

        driver = _Driver(space=space, study=study, store=store, job=job, executor=executor,
                         candidates=candidates, target=target, on_progress=on_progress)
        try:
            driver.run()
        except BaseException as e:
            driver.abort("interrupted" if isinstance(e, KeyboardInterrupt) else f"driver failed: {e}")
            store.set_job_status(name, "interrupted" if isinstance(e, KeyboardInterrupt) else "failed",
                                 error=str(e).splitlines()[0] if str(e) else type(e).__name__)
            raise
    finally:
        executor.close()
    store.set_job_status(name, "finished")
    summary = JobSummary(
        study_name=name, storage=redact_url(url), executor=executor.describe,
        complete=driver.count(TrialState.COMPLETE), failed=driver.count(TrialState.FAIL),
        front=pareto_front(study, space.max_ne_gap), overhead=driver.overhead(),
    )
    store.close()
    return summary


def check_space(space: SearchSpace) -> tuple[list[str], list[tuple[str, dict[str, Any]]]]:
    """Check a space against its workload's model (candidates exist, seeds fit the space);
    returns the candidates and the seeds' trial parameters. Builds the model once, on the CPU."""
    try:
        workload = get_workload(space.workload, space.workload_args)
    except EraseTuneError as e:
        raise EraseTuneError(f"{space.source}: {e}") from None
    model = workload.build_model()
    candidates = list(space.candidates or workload.cut_candidates)
    for c in candidates:
        try:
            ErasePlan(cuts=(Cut(module=c),)).check_model(model)
        except EraseTuneError as e:
            raise EraseTuneError(f"{space.source}: cuts.candidates: {str(e).split(': ', 1)[1]}") from None
    seeds = []
    for i, (seed_name, plan) in enumerate(space.seeds):
        try:
            plan.check_model(model)
            seeds.append((seed_name, plan_params(space, plan, candidates)))
        except EraseTuneError as e:
            raise EraseTuneError(f"{space.source}: seeds[{i}] ({seed_name}): {e}") from None
    return candidates, seeds


class _Driver:
    def __init__(self, *, space: SearchSpace, study: optuna.Study, store: Store, job: Any, executor: RayExecutor,
                 candidates: list[str], target: int, on_progress: Callable[[Progress], None]) -> None:
        self.space, self.study, self.store, self.job = space, study, store, job
        self.executor, self.candidates, self.target = executor, candidates, target
        self.on_progress = on_progress
        self.inflight: dict[TrialHandle, optuna.Trial] = {}
        self.measured: dict[str, optuna.trial.FrozenTrial] = {}
        self.baseline_ne: dict[str, float] = {}
        self.env: tuple[str, str] | None = None  # (device name, torch version) of the workers
        self.driver_s: list[float] = []
        self.dispatch_s: list[float] = []
        self.startup_s: list[float] = []
        self.trial_s: list[float] = []
        self.last_heartbeat = 0.0

    # -- bookkeeping ---------------------------------------------------------------------

    def count(self, *states: TrialState) -> int:
        return len(self.study.get_trials(deepcopy=False, states=states or _FINISHED))

    def best(self) -> FrontPoint | None:
        front = pareto_front(self.study, self.space.max_ne_gap)
        return front[0] if front else None

    def emit(self, event: str, message: str) -> None:
        self.on_progress(Progress(event=event, message=message, done=self.count(TrialState.COMPLETE),
                                  failed=self.count(TrialState.FAIL), running=len(self.inflight),
                                  target=self.target, best=self.best()))

    def overhead(self) -> dict[str, float]:
        """Mean seconds per run trial; ``fraction`` = (driver + dispatch) / trial, and
        ``fraction_with_startup`` also counts the fresh worker process's imports."""
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        out = {"driver_s": mean(self.driver_s), "dispatch_s": mean(self.dispatch_s),
               "startup_s": mean(self.startup_s), "trial_s": mean(self.trial_s), "trials": float(len(self.trial_s))}
        sched = out["driver_s"] + out["dispatch_s"]
        out["fraction"] = sched / out["trial_s"] if out["trial_s"] else 0.0
        out["fraction_with_startup"] = (sched + out["startup_s"]) / out["trial_s"] if out["trial_s"] else 0.0
        return out

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        self.fail_stale()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if Attr.PLAN_KEY in t.user_attrs and Attr.DUPLICATE_OF not in t.user_attrs:
                self.measured.setdefault(t.user_attrs[Attr.PLAN_KEY], t)
        finished = self.count()
        self.emit("started", f"job {self.study.study_name}: {finished}/{self.target} trials done; {self.executor.describe}")
        while True:
            while len(self.inflight) < self.executor.slots and finished + len(self.inflight) < self.target:
                finished += self.ask_and_submit()
            if not self.inflight:
                break
            for handle, outcome in self.executor.wait(timeout=0.5):
                self.record(handle, outcome)
                finished += 1
            now = time.monotonic()
            for handle in list(self.inflight):
                if handle.cancel_reason is None and now - handle.started > self.space.timeout_s:
                    self.executor.cancel(handle, f"timed out after {self.space.timeout_s:.0f}s")
            if now - self.last_heartbeat > HEARTBEAT_EVERY_S:
                self.heartbeat()
        self.emit("done", f"job {self.study.study_name} done")

    def ask_and_submit(self) -> int:
        """Ask one trial; returns 1 if it finished at once (a repeat of a measured plan)."""
        t0 = time.perf_counter()
        trial = self.study.ask()
        plan = self.space.plan_from_trial(trial, self.candidates)
        key = plan.dumps()
        trial.set_user_attr(Attr.PLAN, plan.to_dict())
        trial.set_user_attr(Attr.PLAN_KEY, key)
        trial.set_user_attr(Attr.MAX_NE_GAP, self.space.max_ne_gap)
        earlier = self.measured.get(key)
        if earlier is not None:
            for attr in (Attr.METRICS, Attr.NE_GAP):  # measured there, not run here: no node/device
                if attr in earlier.user_attrs:
                    trial.set_user_attr(attr, earlier.user_attrs[attr])
            trial.set_user_attr(Attr.DUPLICATE_OF, earlier.number)
            set_ne_constraint(trial, earlier.values[1], self.space.max_ne_gap)
            self.study.tell(trial, earlier.values)
            self.emit("duplicate", f"trial {trial.number}: same plan as trial {earlier.number}, not re-run")
            return 1
        trial.set_user_attr(Attr.HEARTBEAT, time.time())
        spec = TrialSpec(trial_number=trial.number, workload=self.space.workload,
                         workload_args=dict(self.space.workload_args), plan=plan.to_dict(),
                         budget=dataclasses.asdict(self.space.budget),
                         baseline_ne=self.baseline_ne.get(self.baseline_key()) if self.env else None)
        handle = self.executor.submit(spec)
        handle.plan_yaml, handle.plan_summary = key, plan.describe()
        self.inflight[handle] = trial
        handle.driver_s = time.perf_counter() - t0
        return 0

    def record(self, handle: TrialHandle, outcome: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        trial = self.inflight.pop(handle)
        plan_yaml = handle.plan_yaml
        for attr, key in ((Attr.DEVICE, "device"), (Attr.NODE, "ray_node"), (Attr.GPU, "gpu_ids"), (Attr.DURATION, "duration_s")):
            if outcome.get(key) is not None:
                trial.set_user_attr(attr, outcome[key])
        status, reason, metrics = outcome["status"], outcome.get("reason"), outcome.get("metrics") or {}
        if status == "complete":
            try:
                values = objective_values(metrics, self.space.gain_over)
            except EraseTuneError as e:
                values, status, reason = [], "failed", str(e)
            if status == "complete" and not all(math.isfinite(v) for v in values):
                status, reason = "failed", f"non-finite objectives {values}"
        if status == "complete":
            prov = outcome.get("provenance") or {}
            trial.set_user_attr(Attr.METRICS, metrics)
            trial.set_user_attr(Attr.NE_GAP, metrics["ne_gap"])
            set_ne_constraint(trial, metrics["ne_gap"], self.space.max_ne_gap)
            trial.set_user_attr(Attr.PROVENANCE, {k: prov.get(k) for k in ("device_name", "torch", "cuda", "hostname", "date_utc", "training_steps")})
            frozen = self.study.tell(trial, values)
            self.measured.setdefault(plan_yaml, frozen)
            self.env = (str(prov.get("device_name")), str(prov.get("torch")))
            if not prov.get("baseline_ne_cached"):
                self.baseline_ne.setdefault(self.baseline_key(), metrics["ne_baseline"])
                self.store.put_baseline(self.baseline_key(), {"ne_baseline": metrics["ne_baseline"],
                                                              "p90_qps": metrics.get("baseline_p90_qps")},
                                        {"baseline": outcome.get("samples", {}).get("baseline", [])})
            message = (f"trial {trial.number}: gain {values[0]:+.2%}, NE gap {values[1]:+.2%} "
                       f"({handle.plan_summary}; {outcome.get('duration_s', 0):.0f}s on {outcome.get('device', '?')})")
        else:
            trial.set_user_attr(Attr.FAILURE, reason)
            self.study.tell(trial, state=TrialState.FAIL)
            message = f"trial {trial.number}: FAILED: {reason}"
        self.store.record_trial(
            self.job, trial.number, plan_yaml=plan_yaml, status="complete" if status == "complete" else "failed",
            failure_reason=reason if status != "complete" else None, metrics=metrics,
            samples=outcome.get("samples") or {}, device=outcome.get("device"), ray_node=outcome.get("ray_node"),
            duration_s=outcome.get("duration_s"),
        )
        self.account(handle, outcome, t0)
        self.emit("trial", message)

    def account(self, handle: TrialHandle, outcome: dict[str, Any], t0: float) -> None:
        """Split the trial's wall time: driver work, Ray dispatch and return, worker start, trial.

        Ray starts a fresh process per trial (isolation): from its creation to the task's
        first line (interpreter, torch and erase-tune imports) counts as worker start-up,
        not as scheduling.
        """
        received = time.time()
        entered = outcome.get("entered_at") or outcome.get("started_at") or handle.submitted_at
        born = outcome.get("process_started_at") or entered
        born = min(max(born, handle.submitted_at), entered)  # a prestarted worker started nothing for us
        ready = outcome.get("ready_at") or entered
        finished = outcome.get("finished_at") or received
        self.driver_s.append(handle.driver_s + time.perf_counter() - t0)
        self.dispatch_s.append(max(0.0, born - handle.submitted_at) + max(0.0, received - finished))
        self.startup_s.append(max(0.0, ready - born))
        self.trial_s.append(max(0.0, finished - ready))

    def baseline_key(self) -> str:
        assert self.env is not None
        args = {**dict(self.space.workload_args), "_budget": dataclasses.asdict(self.space.budget)}
        return baseline_key(self.space.workload, args, self.env[0], self.env[1])

    def heartbeat(self) -> None:
        self.last_heartbeat = time.monotonic()
        for trial in self.inflight.values():
            trial.set_user_attr(Attr.HEARTBEAT, time.time())

    def fail_stale(self) -> None:
        """RUNNING trials nobody has beaten the heart of lately belong to a dead driver."""
        now = time.time()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            beat = t.user_attrs.get(Attr.HEARTBEAT)
            if beat is None and t.datetime_start is not None:
                # Another driver may be between ask() and its first heartbeat: judge by start.
                beat = t.datetime_start.timestamp()
            if beat is None or now - float(beat) > STALE_AFTER_S:
                reason = "stale: its driver stopped before the trial finished"
                self.study._storage.set_trial_user_attr(t._trial_id, Attr.FAILURE, reason)
                self.study.tell(t.number, state=TrialState.FAIL)
                self.emit("stale", f"trial {t.number}: {reason}")

    def abort(self, reason: str) -> None:
        for handle, trial in list(self.inflight.items()):
            self.executor.cancel(handle, reason)
            trial.set_user_attr(Attr.FAILURE, reason)
            self.study.tell(trial, state=TrialState.FAIL)
        self.inflight.clear()
