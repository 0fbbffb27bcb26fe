"""The ask → submit → tell loop of one driver; any number of drivers may share a study.

Admission happens under the study's lock (:meth:`Storage.lock`): count what the study
holds, ask Optuna for a trial, turn it into a canonical plan and decide, all atomically with
respect to other drivers. So the target is the study's, not each driver's (the study ends
with ``target`` measured trials however many drivers run), and no plan is run that another
driver has measured, is running, or saw fail. Repeats of measured plans are answered from
the earlier trial and do not count; trial failures are recorded once and do not count
either; infrastructure failures are retried on a fresh worker group first. A failure that
is systematic (the baseline itself cannot run, or the first trials all fail the same way
while none has been measured) stops the job instead of spending its budget on more of it.

Liveness is Optuna's heartbeat: every driver beats for its own running trials and fails
other drivers' trials whose heartbeat went stale (``fail_stale_trials``); the loop ends
only when the study has its measured trials and nothing is RUNNING, so a re-run right
after a ``kill -9`` finishes the job with no trial left RUNNING.

Storage calls are made directly: the storage retries them itself while it is away
(:mod:`erase_tune.store.retry`) and raises :class:`StorageLost` when it stays away. Writes
made while the loop is already failing (failing an asked trial, :meth:`Loop.abort`) are tried
once (:meth:`Storage.once`), so a lost storage is not waited for twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.storages import fail_stale_trials
from optuna.trial import FrozenTrial, TrialState

from erase_tune._signals import signals_deferred
from erase_tune.errors import EraseTuneError, one_line, shown
from erase_tune.runtime import ErasePlan
from erase_tune.store.storage import Storage, StorageLost
from erase_tune.measure.trial import BASELINE
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.screen import SEARCH, SEED, Screen, results_of
from erase_tune.tune.execute.executor import RayExecutor, TrialHandle
from erase_tune.tune.run.journal import Entry, Journal
from erase_tune.tune.execute.outcome import TrialOutcome
from erase_tune.tune.run.record import Recorder
from erase_tune.tune.search.space import SearchSpace
from erase_tune.tune.search.study import Attr, FrontPoint, measured, pareto_front
from erase_tune.tune.execute.task import TrialSpec

__all__ = ["Progress", "Loop", "LoopSpace", "LoopBooks", "HEARTBEAT_S", "MAX_INFRA_RETRIES", "SYSTEMATIC_FAILURES", "systematic_failure"]

log = logging.getLogger(__name__)

HEARTBEAT_S = 5
"""Seconds between a driver's heartbeats for its running trials (Optuna's heartbeat_interval)."""
MAX_INFRA_RETRIES = 2
"""Extra attempts of a trial whose worker, node or environment failed."""
MAX_REPEATS_IN_A_ROW = 50
"""Proposals in a row that repeat known plans: the sampler has nothing new to offer."""
SYSTEMATIC_FAILURES = 3
"""Failed trials, all failing the same way before any trial is measured, that stop the job.
One failure can be its plan's own (a plan that runs out of memory); three different plans
failing alike say the workload or the cluster is at fault, and every later trial would fail
the same way (seen: 12 of 12 trials, 5.5 minutes, lost to one capture error). A failure that
names the baseline stops the job at once: every trial runs the same baseline."""


_OTHER_CHOICES = re.compile("dynamic value space|different distribution kind")
"""Optuna's words when a trial suggests a parameter with other choices than the study's earlier
trials had (a job resumed with a space whose modes, candidates or ranges changed)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progress:
    """A snapshot for the live display."""

    event: str
    """``started``, ``trial`` (one finished), ``repeat``, ``retry`` or ``done``."""
    message: str
    done: int
    failed: int
    running: int
    target: int
    elapsed_s: float
    eta_s: float | None
    """Estimated seconds left, from the mean trial time so far; None before the first."""
    best: FrontPoint | None


@dataclasses.dataclass(eq=False)
class _Inflight:
    number: int
    plan: ErasePlan
    key: str
    spec: TrialSpec
    handle: TrialHandle | None = None
    attempts: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSpace:
    """What a :class:`Loop` searches: the space, bound to the model, its structural screen
    (None: off) and why the whole-step-graph reference cannot be captured (None: it can)."""

    space: SearchSpace
    checked: BoundSpace
    screen: Screen | None = None
    reference_error: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopBooks:
    """Where a :class:`Loop` keeps its results: the study, its storage, the recorder that writes
    outcomes and the journal of outcomes not yet stored."""

    study: optuna.Study
    storage: Storage
    recorder: Recorder
    journal: Journal


class Loop:
    """One driver's loop over one job (see the module docstring)."""

    def __init__(self, *, what: LoopSpace, books: LoopBooks, executor: RayExecutor, target: int, max_failures: int,
                 on_progress: Callable[[Progress], None]) -> None:
        self.space, self.checked = what.space, what.checked
        self.study, self.storage, self.recorder, self.journal = books.study, books.storage, books.recorder, books.journal
        self.executor = executor
        self.screen = what.screen
        """The structural screen whose plans are enqueued before the sampler proposes; None: off."""
        self.target, self.max_failures, self.on_progress = target, max_failures, on_progress
        self.reference_error = what.reference_error
        """Why the whole-step-graph reference cannot be captured (trials leave it out), or None."""
        self.inflight: list[_Inflight] = []
        self.stopped: str | None = None
        self.started = time.monotonic()
        self.cost: dict[str, list[float]] = {"ask": [], "record": [], "dispatch": [], "trial": []}
        """Seconds per measured trial: admission (ask, plan, locks), recording (tell, tables),
        Ray dispatch and return, and the trial itself in its worker."""
        self._beat = 0.0
        self._repeats = 0
        self.floor_due: Callable[[], float] | None = None
        """Measures the study's NE noise floor and returns its band; set while the study has none
        and the space can detach. Called once, before the first plan with cuts runs."""
        self.deadline: float | None = None
        """``time.monotonic()`` by which the whole job must end (``--time-budget``), or None."""
        self.reserve_s = 0.0
        """Seconds of the time budget kept for the confirmation after the trials."""
        self.first_trial_s: float | None = None
        """What the first trial is expected to take (the job's estimate), before any has run."""

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        self.emit("started", f"job {self.study.study_name}: {self.executor.describe}")
        while True:
            if time.monotonic() - self._beat >= HEARTBEAT_S:
                self.maintain()
            for inf in [i for i in self.inflight if i.handle is None]:  # infrastructure retries
                if self.executor.idle():
                    inf.handle = self.executor.submit(inf.spec)
            while self.stopped is None and self.executor.idle() and self.admit():
                pass
            if not self.inflight and self.finished():
                break
            self._collect()
        self.emit("done", f"job {self.study.study_name}: " + (self.stopped or "done"))

    def _collect(self) -> None:
        """Record the trials that finished within half a second; cancel those past their limit."""
        for handle, outcome in self.executor.wait(timeout=0.5):
            self.finish(handle, outcome)
        now = time.monotonic()
        for inf in self.inflight:
            h = inf.handle
            if h is not None and h.cancel_reason is None and now - h.started > self.space.budget.timeout_s:
                self.executor.cancel(h, f"timed out after {self.space.budget.timeout_s:.0f}s")

    def admit(self) -> bool:
        """Ask and submit one trial if the study needs one; False when it needs none now."""
        t0 = time.perf_counter()
        with self.storage.lock(f"study:{self.study.study_name}"):
            if not self._room():
                return False
            if self.screen is not None:
                # The screen's next plan goes to the queue ask() pops from, oldest first; while
                # anything waits there (the space's seeds, at first) it goes first, and nothing
                # is enqueued twice.
                trials = self.study.get_trials(deepcopy=False)
                step = None if any(t.state == TrialState.WAITING for t in trials) else \
                    self.screen.next(results_of(trials))
                if step is not None:
                    self.study.enqueue_trial(step.params, user_attrs={Attr.PHASE: step.phase,
                                                                      Attr.SCREEN_NAME: step.name})
            trial = None
            try:
                # A signal inside ask() would leave its new trial RUNNING and unknown, and one inside
                # the plan's writes (its parameters, one write each) left it RUNNING and half
                # written (seen with SIGTERM under load: failing it then did not take). Known and
                # whole, in flight before the block ends, the clean-up fails it.
                with signals_deferred():
                    trial = self.study.ask()
                    admitted = self._propose(trial)
                    if not isinstance(admitted, str):
                        self.inflight.append(admitted)  # before submitting: a signal must find it to fail it
            except BaseException:
                if trial is not None:
                    with contextlib.suppress(Exception), self.storage.once():  # never leave an asked trial RUNNING
                        self.study.tell(trial, state=TrialState.FAIL)
                raise
        if isinstance(admitted, str):
            self._repeats += 1
            self.emit("repeat", admitted)
            if self._repeats >= MAX_REPEATS_IN_A_ROW:
                self.stopped = f"the sampler proposed only known plans {self._repeats} times in a row: space exhausted"
                return False
            return True
        self._repeats = 0
        floor_s = 0.0
        if admitted.plan.cuts and self.floor_due is not None:  # a phase of its own, not this trial's overhead
            t1 = time.perf_counter()
            self._measure_floor()
            admitted.spec = dataclasses.replace(admitted.spec, stop_below=self._stop_below())
            floor_s = time.perf_counter() - t1
        admitted.handle = self.executor.submit(admitted.spec)
        self.cost["ask"].append(time.perf_counter() - t0 - floor_s)
        return True

    def _room(self) -> bool:
        """Whether the study needs another trial now (its target counts every driver's)."""
        trials = self.study.get_trials(deepcopy=False)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        if len(measured(self.study, trials)) + running >= self.target:
            return False
        if self.deadline is not None and self._out_of_time():
            return False
        failed = [t for t in trials if t.state == TrialState.FAIL and Attr.FAILURE_KIND in t.user_attrs]
        if len(failed) >= self.max_failures:
            self.stopped = f"{len(failed)} trials failed (last: {failed[-1].user_attrs.get(Attr.FAILURE)})"
            return False
        return True

    def _propose(self, trial: optuna.Trial) -> _Inflight | str:
        """Turn an asked trial into a plan: a new one to run, or a repeat answered at once.
        Every write here is idempotent, so the storage's retry after a lost connection repeats it safely."""
        self.storage.heartbeat(self.recorder.trial_id(trial.number))
        try:
            plan = self.checked.plan(trial)
        except ValueError as e:  # Optuna's: a parameter the study was tuned over with other choices
            if isinstance(e, EraseTuneError) or not _OTHER_CHOICES.search(str(e)):
                raise
            raise EraseTuneError(f"{self.space.source}: offers other choices for a parameter than study "
                                 f"{shown(self.study.study_name)} was tuned over (Optuna: {one_line(e, 120)}): resume "
                                 "it with the space it was started with, or use another study name") from None
        key = plan.dumps()
        trials = self.study.get_trials(deepcopy=False)
        earlier = next((t for t in trials if t.user_attrs.get(Attr.PLAN_KEY) == key
                        and Attr.DUPLICATE_OF not in t.user_attrs and t.number != trial.number
                        and (t.state in (TrialState.COMPLETE, TrialState.RUNNING)
                             or t.user_attrs.get(Attr.FAILURE_KIND) == "trial")), None)
        if earlier is not None:
            return self.recorder.duplicate(trial, earlier, key)
        phase = trial.user_attrs.get(Attr.PHASE) or (SEED if Attr.SEED_NAME in trial.user_attrs else SEARCH)
        self.storage.set_user_attrs(self.recorder.trial_id(trial.number), {
            Attr.PLAN: plan.to_dict(), Attr.PLAN_KEY: key, Attr.PLAN_SUMMARY: plan.describe(),
            Attr.MAX_NE_GAP: self.space.max_ne_gap, Attr.PHASE: phase})
        spec = TrialSpec(trial_number=trial.number, workload=self.space.workload.name,
                         workload_args=dict(self.space.workload.args), plan=plan.to_dict(),
                         budget=dataclasses.asdict(self.space.budget.per_trial),
                         baseline_ne=self.recorder.baseline_ne(),
                         reference_error=self.reference_error, gain_over=self.space.gain_over,
                         stop_below=self._stop_below())
        return _Inflight(number=trial.number, plan=plan, key=key, spec=spec)

    def finish(self, handle: TrialHandle, outcome: TrialOutcome) -> None:
        inf = next(i for i in self.inflight if i.handle is handle)
        failure = outcome.failure
        if failure is not None and failure.kind == "infra" and inf.attempts <= MAX_INFRA_RETRIES \
                and self.stopped is None:
            inf.attempts += 1
            inf.handle = None  # resubmitted on the next free (fresh) slot
            self.emit("retry", f"trial {inf.number}: {failure.reason}; retrying (attempt {inf.attempts})")
            return
        received, t0 = time.time(), time.perf_counter()
        entry = Entry(trial_number=inf.number, plan_key=inf.key, attempts=inf.attempts, outcome=outcome)
        self.journal.write(entry)  # before the storage: a lost storage must not lose the measurement
        message = self.recorder.record(inf.number, inf.key, outcome, inf.attempts)
        self.journal.remove(inf.number)
        self.inflight.remove(inf)
        if failure is not None and self.stopped is None:
            self.stopped = systematic_failure(self.study)
        w = outcome.worker
        if outcome.complete:
            self.cost["record"].append(time.perf_counter() - t0)
            self.cost["dispatch"].append(max(0.0, w.started_at - handle.submitted_at) + max(0.0, received - w.finished_at))
            self.cost["trial"].append(max(0.0, w.finished_at - w.started_at))
        self.emit("trial", message)

    # -- liveness ------------------------------------------------------------------------------

    def maintain(self) -> None:
        """Beat for this driver's trials and fail other drivers' stale ones. A storage that
        does not answer here is not fatal yet (a missed beat only risks our trials being
        failed later): the next write the job depends on decides, and journals what it holds."""
        self._beat = time.monotonic()

        def beat() -> None:
            for inf in self.inflight:
                self.storage.heartbeat(self.recorder.trial_id(inf.number))
            fail_stale_trials(self.study)
            # A trial asked by a driver that died before its first heartbeat has no heartbeat
            # for Optuna to find stale, and no plan: fail it once it is older than the grace.
            grace = dt.timedelta(seconds=self.storage.grace_period or 2 * HEARTBEAT_S)
            now = dt.datetime.now()
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if Attr.PLAN_KEY not in t.user_attrs and t.datetime_start and now - t.datetime_start > grace:
                    with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                        self.study.tell(t.number, state=TrialState.FAIL)

        try:
            beat()
        except StorageLost as e:
            log.warning("%s (continuing: the next result decides)", e)

    def finished(self) -> bool:
        """The study holds its target (or this driver stopped) and nothing is RUNNING anywhere."""
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        enough = len(measured(self.study)) >= self.target or self.stopped is not None
        return enough and not running

    def abort(self, reason: str) -> None:
        """Fail this driver's trials in the study, so nothing stays RUNNING, then cancel them:
        the storage first, as Ray may be what stopped (its processes ended with this one)."""
        for inf in self.inflight:
            try:
                with self.storage.once():  # the storage may be what failed: not waited for again
                    self.study.tell(inf.number, state=TrialState.FAIL)
            except Exception:  # noqa: BLE001 - the storage may be what failed
                pass
        for inf in self.inflight:
            if inf.handle is not None:
                self.executor.cancel(inf.handle, reason)
        self.inflight.clear()

    # -- the noise floor, the race and the clock ------------------------------------------------

    def _measure_floor(self) -> None:
        """Measure the noise floor (:attr:`floor_due`) while beating for this driver's trials,
        then judge feasibility by it from here on (recorder and sampler)."""
        measure, self.floor_due = self.floor_due, None
        assert measure is not None
        # It runs on a free trial slot. The slot may be held by a trial that has finished but is
        # not recorded yet, and only this thread records: record until a slot is free, or the
        # floor waits for a slot nobody gives back (seen when a node died while its slot was idle).
        while not self.executor.idle():
            self._collect()
            if time.monotonic() - self._beat >= HEARTBEAT_S:
                self.maintain()
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["band"] = measure()
            except BaseException as e:  # noqa: BLE001 - raised again in the driver's thread
                box["error"] = e

        worker = threading.Thread(target=work, name="noise-floor", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(timeout=HEARTBEAT_S)
            if worker.is_alive():
                self.maintain()
        if "error" in box:
            raise box["error"]
        band = float(box["band"])
        self.recorder.band = band
        if hasattr(self.study.sampler, "max_ne_gap"):
            self.study.sampler.max_ne_gap = self.space.max_ne_gap + band

    def _stop_below(self) -> float | None:
        """The racing bound a trial gets: the best lower bound of the feasible trials measured so
        far (a plan whose interval ends below it cannot join the front's top)."""
        bounds = [t.user_attrs.get("gain_lo") for t in measured(self.study)
                  if t.user_attrs.get(Attr.FEASIBLE, True) and Attr.DUPLICATE_OF not in t.user_attrs]
        bounds = [float(b) for b in bounds if isinstance(b, (int, float)) and math.isfinite(b)]
        return max(bounds) if bounds else None

    def seconds_left(self) -> float | None:
        """Seconds until the time budget's end, or None without one."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def _out_of_time(self) -> bool:
        """No trial may start that would run past the budget less the confirmation's reserve; a
        trial is expected to take the longest any took so far (the first: the trial timeout)."""
        done = self.cost["trial"]
        expected = max(done) if done else self.first_trial_s if self.first_trial_s is not None \
            else float(self.space.budget.timeout_s)
        left = self.seconds_left()
        if left is not None and left - self.reserve_s < expected:
            if self.stopped is None:
                self.stopped = "time budget reached"
            return True
        return False

    # -- helpers -------------------------------------------------------------------------------

    def overhead(self) -> dict[str, float]:
        """Mean seconds per measured trial of each cost; ``per_trial``: what each trial costs the
        driver (ask, record, dispatch) as a fraction of trial time; ``fraction``: the same with the
        workers' start-up (once per slot per job, before trial 0) amortised over the trials."""
        out = {k: (sum(v) / len(v) if v else 0.0) for k, v in self.cost.items()}
        n = len(self.cost["trial"])
        out["worker_start"] = self.executor.worker_start_s / n if n else 0.0
        out["trials"] = float(n)
        per_trial = out["ask"] + out["record"] + out["dispatch"]
        out["per_trial"] = per_trial / out["trial"] if out["trial"] else 0.0
        out["fraction"] = (per_trial + out["worker_start"]) / out["trial"] if out["trial"] else 0.0
        return out

    def counts(self, trials: Sequence[FrozenTrial] | None = None) -> tuple[int, int]:
        """(measured trials, failed trials) of the study (of ``trials``, when read already)."""
        if trials is None:
            trials = self.study.get_trials(deepcopy=False)
        return len(measured(self.study, trials)), sum(t.state == TrialState.FAIL and Attr.FAILURE_KIND in t.user_attrs
                                                       for t in trials)

    def emit(self, event: str, message: str) -> None:
        trials = self.study.get_trials(deepcopy=False)
        done, failed = self.counts(trials)
        front = pareto_front(self.study, self.space.max_ne_gap, trials)
        elapsed = time.monotonic() - self.started
        left = max(0, self.target - done)
        trial_s = self.cost["trial"]
        mean = sum(trial_s) / len(trial_s) if trial_s else None
        eta = None if mean is None else mean * left / max(1, self.executor.slots)
        self.on_progress(Progress(event=event, message=message, done=done, failed=failed,
                                  running=len(self.inflight), target=self.target, elapsed_s=elapsed, eta_s=eta,
                                  best=front[0] if front else None))


def systematic_failure(study: optuna.Study) -> str | None:
    """Why the job should stop, when its failures are systematic (see :data:`SYSTEMATIC_FAILURES`):
    one line naming the failure, or None. Nothing is systematic once a trial has been measured."""
    if measured(study):
        return None
    failed = [t for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if Attr.FAILURE_KIND in t.user_attrs]
    reasons = [str(t.user_attrs.get(Attr.FAILURE, "")) for t in failed]
    baseline = next((r for r in reasons if r.startswith(f"{BASELINE}:")), None)
    if baseline is not None:
        return f"the baseline cannot run, so no trial can: {baseline}"
    kinds = {_failure_kind(r, str(t.user_attrs.get(Attr.PLAN_SUMMARY, ""))) for r, t in zip(reasons, failed)}
    if len(failed) >= SYSTEMATIC_FAILURES and len(kinds) == 1:
        return f"the first {len(failed)} trials all failed the same way: {reasons[-1]}"
    return None


def _failure_kind(reason: str, plan: str) -> str:
    """``reason`` without what differs between plans that fail alike: the plan's own
    description, parenthesised details and numbers (sizes, counts, module indices)."""
    if plan:
        reason = reason.replace(plan, "")
    return re.sub(r"\d+", "#", re.sub(r"\([^()]*\)", "()", reason)).strip()
