"""Recording an outcome: the study learns the objectives, erase-tune's tables the raw data.

Each fact is stored once. The Optuna trial gets the objective values, the NE constraint
(system attribute ``constraints``: the budget plus the study's noise floor; a plan whose
gradients the trial checked equal to the baseline's is *exact*: NE-gap objective 0, never
trained for NE)
and the flat metric attributes that the dashboard,
``status``, ``export`` and the report read; ``et_trial_outcomes`` gets what a worker sent
beyond those numbers (per-step samples with their windows, provenance, the failure's
traceback). A baseline NE measured by a trial goes to the baseline cache, which later
trials (and a resumed job) reuse instead of training the baseline again.

Recording is idempotent, and a trial finished by someone else first is not an error. Another
party can finish a trial between this driver's reading it and its writes: a driver that
failed it as stale (``fail_stale_trials``: our heartbeat lapsed), or a driver starting on
the same host that replayed this trial's journal entry (the journal is written before the
study is told). Whatever the other party stored is kept as it is, and one line is logged:

- finished COMPLETE: that is this very outcome, replayed from the journal; nothing is added.
- failed, and this outcome is a measurement: the measurement is valid (the trial ran; only
  its heartbeat lapsed), so it is added to the study as a new trial (user attribute
  ``replayed_from``), once: a later replay finds that trial and adds nothing. Not when the
  study has moved on meanwhile (a driver paused past the grace period, resumed after the
  others carried on): if its plan was measured since, or the study holds the job's target of
  measured trials already, the measurement is not added (the study would hold a plan twice,
  or more trials than ``--trials``); the trial's row says why it was not kept.
- failed, and this outcome is a failure: nothing is added.

erase-tune's row for the trial (``et_trial_outcomes``) is then written only if it has none
yet; a new trial holding the measurement gets a row of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from erase_tune.store import Job, OutcomeRecord, baseline_key
from erase_tune.store.storage import Storage
from erase_tune.tune.execute.outcome import Failure, TrialOutcome
from erase_tune.tune.search.space import SearchSpace
from erase_tune.measure.confirm import baseline_plan
from erase_tune.measure.quality import feasible
from erase_tune.tune.search.study import CONSTRAINTS, Attr, constraint, measured, metric_attrs, objective_values

__all__ = ["Recorder", "REPLAYED_FROM"]

log = logging.getLogger(__name__)

REPLAYED_FROM = "replayed_from"
"""User attribute of a trial that holds the measurement of trial N, which was failed as stale first."""


class Recorder:
    """Writes outcomes of one job's trials (see the module docstring)."""

    def __init__(self, *, study: optuna.Study, storage: Storage, job: Job, space: SearchSpace) -> None:
        self.study, self.storage, self.job, self.space = study, storage, job, space
        self._study_id = storage.study_id(study.study_name)
        self.band = 0.0
        """The study's noise floor band (erase_tune.measure.noise): gaps within the budget plus it are feasible."""
        self.env: tuple[str, str] | None = None
        """(device name, torch version) of the last measured trial: the baseline cache's key."""
        self._passes_said = False
        """Whether the job was told its trials re-read their batches (once per driver)."""
        latest = storage.store.latest_provenance(job)
        if latest is not None and latest.get("device_name"):
            self.env = (str(latest["device_name"]), str(latest.get("torch")))

    def trial_id(self, number: int) -> int:
        return self.storage.trial_id(self._study_id, number)

    def baseline_ne(self) -> float | None:
        """The cached baseline NE for this job's workload, budget and device, if any."""
        if self.env is None:
            return None
        entry = self.storage.store.get_baseline(self._baseline_key())
        return None if entry is None else entry.metrics.get("ne_baseline")

    def record(self, number: int, plan_key: str, outcome: TrialOutcome, attempts: int) -> str:
        """Store one outcome; returns the progress line for it."""
        attrs: dict[str, Any] = {Attr.ATTEMPTS: attempts, Attr.NODE: outcome.worker.node}
        values: list[float] | None = None
        failure = outcome.failure
        result = outcome.result
        if result is not None:
            metrics = metric_attrs(result)
            values = objective_values(metrics, self.space.gain_over)
            exact = bool(result.exact)
            if exact:  # gradients checked equal to the baseline's: the same training, gap 0
                values[1] = 0.0
            if result.plan.canonical() == baseline_plan(self.space.gain_over).canonical():
                values[0] = 0.0  # the baseline against itself: what it measured is the noise of an A/A pair
            if not all(math.isfinite(v) for v in values):
                values, failure = None, Failure(kind="trial", reason=f"non-finite objectives {values}")
        if values is not None and result is not None:
            prov = dict(result.provenance)
            attrs.update(metric_attrs(result))
            attrs.update({Attr.DEVICE: prov.get("device_name"), Attr.DURATION: result.duration_s,
                          Attr.MAX_NE_GAP: self.space.max_ne_gap, Attr.EXACT: exact, Attr.NOISE_BAND: self.band,
                          Attr.FEASIBLE: feasible(values[1], self.space.max_ne_gap, self.band, exact=exact)})
            self.env = (str(prov.get("device_name")), str(prov.get("torch")))
            if not prov.get("baseline_ne_cached") and result.ne_baseline is not None:
                self.storage.store.put_baseline(self._baseline_key(), {"ne_baseline": result.ne_baseline},
                                                {"baseline": result.variants["baseline"].steps_s})
            if not exact and not self._passes_said and result.data_note is not None:
                self._passes_said = True  # every trial of the job trains as long: said once, with the first
                log.warning(f"trial {number}: {result.data_note}; every trial of this job trains {prov.get('training_steps')} "
                            "steps, so its NE gaps and the noise floor may mislead")
            gap = "NE gap 0 (exact)" if exact else f"NE gap {values[1]:+.2%}"
            message = (f"trial {number}: gain {values[0]:+.2%} [{result.gain_lo:+.2%}, {result.gain_hi:+.2%}] over "
                       f"{result.windows} windows ({result.stopped}), {gap} "
                       f"({result.plan.describe()}; {result.duration_s:.0f}s on {prov.get('device_name', '?')})")
        else:
            assert failure is not None
            attrs.update({Attr.FAILURE_KIND: failure.kind, Attr.FAILURE: failure.reason})
            message = f"trial {number}: FAILED ({failure.kind}): {failure.reason}"
        held = self._finish(number, values, attrs)
        if isinstance(held, str):  # a measurement the study has no room for any more: see the module docstring
            values, failure, held = None, Failure(kind="infra", reason=held), None
            message = f"{message}; not kept: {failure.reason}"
        rows = [number] if held == number or self.storage.store.outcome(self.job, number) is None else []
        if held is not None and held != number:
            rows.append(held)  # the new trial holding the measurement gets its samples and provenance too
        for n in rows:  # a row another party stored for a trial it finished is kept as it is
            self.storage.store.record_outcome(self.job, n, OutcomeRecord(
                plan_yaml=plan_key, status="complete" if values is not None else "failed",
                failure_kind=None if values is not None else failure.kind,
                failure_reason=None if values is not None else failure.reason,
                traceback=None if values is not None else failure.traceback, attempts=attempts,
                node=outcome.worker.node,
                samples={k: {"steps_s": list(v.steps_s), "window": list(v.window)} for k, v in result.variants.items()}
                if result is not None else {},
                provenance=dict(result.provenance) if result is not None else {"pid": outcome.worker.pid},
            ))
        return message

    def duplicate(self, trial: optuna.Trial, earlier: FrozenTrial, plan_key: str) -> str:
        """A plan already measured (or being measured, or failed) by another trial: answer
        from it without running. Repeats of measured plans inform the sampler and count for
        nothing; repeats of running or failed ones are failed trials marked as repeats."""
        trial.set_user_attr(Attr.PLAN_KEY, plan_key)
        trial.set_user_attr(Attr.DUPLICATE_OF, earlier.number)
        if earlier.state == TrialState.COMPLETE and earlier.values is not None:
            self.storage.set_constraints(self.trial_id(trial.number),
                                         [self._constraint(earlier.values[1], earlier.user_attrs)])
            self.study.tell(trial, earlier.values)
            return f"trial {trial.number}: same plan as trial {earlier.number}, not run again"
        what = "running" if earlier.state == TrialState.RUNNING else "failed"
        trial.set_user_attr(Attr.FAILURE, f"same plan as trial {earlier.number} ({what})")
        self.study.tell(trial, state=TrialState.FAIL)
        return f"trial {trial.number}: same plan as trial {earlier.number} ({what}), not run"

    # -- internals -----------------------------------------------------------------------------

    def _finish(self, number: int, values: list[float] | None, attrs: dict[str, Any]) -> int | str | None:
        """Finish trial ``number`` with ``values`` (None: failed) and ``attrs``; returns the trial
        that holds this outcome now: ``number``, or, when another party had finished it first (see
        the module docstring; also midway through these writes), the new trial holding the
        measurement, or None (what the other party stored stands alone), or why a measurement
        failed as stale is not kept."""
        db = self.storage
        tid = self.trial_id(number)
        frozen = db.trial(tid)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        if frozen.state == TrialState.RUNNING:
            try:
                db.set_user_attrs(tid, attrs)
                if values is not None:
                    db.set_constraints(tid, [self._constraint(values[1], attrs)])
                    self.study.tell(number, values)
                else:
                    self.study.tell(number, state=TrialState.FAIL)
                return number
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
                # ValueError: Optuna's tell() refusing a trial it reads as finished ("Cannot tell a
                # COMPLETE trial"); anything else leaves the trial RUNNING and is raised.
                frozen = db.trial(tid)
                if not frozen.state.is_finished():
                    raise
        return self._finished_elsewhere(number, frozen, values, attrs)

    def _finished_elsewhere(self, number: int, frozen: FrozenTrial, values: list[float] | None,
                            attrs: dict[str, Any]) -> int | str | None:
        state = frozen.state.name
        if frozen.state != TrialState.FAIL or values is None:
            log.warning("trial %d was already finished (%s) by another driver; kept as stored", number, state)
            return None
        # Failed as stale (its heartbeat lapsed, or the storage was away): the measurement itself
        # is sound, so the study gets it as a new trial, once.
        earlier = self._replay_of(number)
        if earlier is not None:
            log.warning("trial %d was failed as stale; its measurement is already stored as trial %d",
                        number, earlier)
            return earlier
        moved_on = self._moved_on(frozen)
        if moved_on is not None:
            log.warning("trial %d was failed as stale by another driver before its result came in; %s, so its "
                        "measurement is not kept", number, moved_on)
            return moved_on
        self.study.add_trial(optuna.trial.create_trial(
            params=frozen.params, distributions=frozen.distributions, values=values,
            user_attrs={**frozen.user_attrs, **attrs, REPLAYED_FROM: number},
            system_attrs={CONSTRAINTS: [self._constraint(values[1], attrs)]}))
        added = self._replay_of(number)
        log.warning("trial %d was failed as stale by another driver before its result came in; "
                    "its measurement is stored as trial %s", number, added)
        return added

    def _moved_on(self, frozen: FrozenTrial) -> str | None:
        """Why the study has no room any more for the measurement of ``frozen`` (failed as
        stale), or None: its plan measured by another trial since, or the job's target reached."""
        done = measured(self.study, self.study.get_trials(deepcopy=False))
        key = frozen.user_attrs.get(Attr.PLAN_KEY)
        again = next((t.number for t in done if key is not None and t.user_attrs.get(Attr.PLAN_KEY) == key), None)
        if again is not None:
            return f"its plan was measured since as trial {again}"
        target = self.job.n_trials_target
        if target is not None and len(done) >= target:
            return f"the study holds its {target} measured trial(s) already"
        return None

    def _replay_of(self, number: int) -> int | None:
        """The trial holding the measurement of trial ``number`` (failed as stale), if any."""
        return next((t.number for t in self.study.get_trials(deepcopy=False)
                     if t.user_attrs.get(REPLAYED_FROM) == number), None)

    def _constraint(self, ne_gap: float, attrs: dict[str, Any]) -> float:
        return constraint(ne_gap, self.space.max_ne_gap, self.band, exact=bool(attrs.get(Attr.EXACT)))

    def _baseline_key(self) -> str:
        assert self.env is not None
        # The fields the service reads around the trials (noise floor, quality) change no baseline.
        budget = {k: v for k, v in dataclasses.asdict(self.space.budget.per_trial).items()
                  if k not in ("noise_repeats", "quality_scale", "quality_seeds")}
        args = {**dict(self.space.workload.args), "_budget": budget}
        if self.space.gpus_per_trial > 1:  # k ranks train on k times the data: another baseline NE
            args["_ranks"] = self.space.gpus_per_trial
        return baseline_key(self.space.workload.name, args, self.env[0], self.env[1])

