"""Two parties finishing one trial (issue 30): a driver recording a trial's outcome while
another driver finishes the same trial first, through its own connection to the same storage.

The other party is real and acts at a chosen point between the recording driver's writes (the
recording driver's own write then runs against a trial that is already finished):

- ``stale``: another driver's ``fail_stale_trials`` fails the trial (its heartbeat lapsed);
- ``replay``: another driver starting on the same host replays the trial's journal entry
  (the journal is written before the study is told) with its own :class:`Recorder`.

The recording driver must not raise, the trial's measurement must be stored exactly once, and
what the other party stored must stay as it stored it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from erase_tune.runtime import Cut, ErasePlan
from erase_tune.store.storage import Storage, open_storage
from erase_tune.measure.trial import run_trial
from erase_tune.tune.execute.outcome import Failure, TrialOutcome, WorkerInfo
from erase_tune.tune.run.record import REPLAYED_FROM, Recorder
from erase_tune.tune.search.space import SearchSpace
from erase_tune.tune.search.study import Attr, metric_attrs, objective_values, open_study
from erase_tune.workloads import get_workload

SPACE = SearchSpace.load(Path(__file__).resolve().parents[2] / "search_spaces" / "ctr-smoke.yaml")
PLAN = ErasePlan(cuts=(Cut(module="subarchs.0", stream=1),), num_streams=1)
NAME = "race"


@pytest.fixture(scope="module")
def measured_outcome() -> TrialOutcome:
    """A real trial's outcome (the ctr proxy on the CPU, a short budget)."""
    per_trial = SPACE.budget.per_trial
    budget = dataclasses.replace(per_trial, max_windows=per_trial.windows, quality_steps=20)
    result = run_trial(get_workload(SPACE.workload.name, SPACE.workload.args), PLAN, budget, device="cpu",
                       reference_error=None)
    return TrialOutcome(trial_number=0, result=result, worker=WorkerInfo(node="node-a", pid=1))


FAILED = TrialOutcome(trial_number=0, failure=Failure(kind="trial", reason="out of memory"),
                      worker=WorkerInfo(node="node-a", pid=1))


def _open(url: str) -> Storage:
    return open_storage(url, heartbeat_interval=1, grace_period=1)


def _driver(db: Storage) -> Recorder:
    study = open_study(db, NAME)
    job = db.store.create_job(study_name=NAME, space_path="ctr-smoke.yaml", space_yaml=SPACE.text,
                              workload=SPACE.workload.name, get_or_create=True)
    return Recorder(study=study, storage=db, job=job, space=SPACE)


def _snapshot(db: Storage, rec: Recorder, number: int):
    t = db.optuna.rdb.get_trial(rec.trial_id(number))
    row = db.store.outcome(rec.job, number)
    return (t.state, t.values, t.user_attrs, t.system_attrs, t.params,
            None if row is None else dataclasses.asdict(row))


@pytest.mark.parametrize(("party", "point", "outcome"), [
    ("stale", "set_trial_user_attrs", "measured"),
    ("stale", "set_trial_state_values", "measured"),
    ("stale", "set_trial_user_attrs", "failed"),
    ("replay", "set_trial_user_attrs", "measured"),
    ("replay", "set_trial_system_attr", "measured"),
    ("replay", "set_trial_state_values", "measured"),
    ("replay", "set_trial_state_values", "failed"),
])
def test_a_trial_finished_by_another_driver_midway_is_recorded_once(storage_url, party, point, outcome,
                                                                     request, monkeypatch, caplog):
    out = request.getfixturevalue("measured_outcome") if outcome == "measured" else FAILED
    db, other_db = _open(storage_url), _open(storage_url)  # two drivers: two engines, two connections
    try:
        rec = _driver(db)
        trial = rec.study.ask()
        n = trial.number
        key = PLAN.dumps()
        trial.set_user_attr(Attr.PLAN_KEY, key)
        db.optuna.record_heartbeat(rec.trial_id(n))
        other = _driver(other_db)
        seen: dict[str, object] = {}

        def other_party_finishes() -> None:
            if party == "stale":
                time.sleep(2.5)  # the driver's last heartbeat is older than the grace period now
                optuna.storages.fail_stale_trials(other.study)
            else:  # the journal entry this driver wrote, replayed by a driver starting beside it
                other.record(n, key, out, 1)
            seen["stored"] = _snapshot(other_db, other, n)

        real = getattr(db.optuna, point)

        def interleaved(*a, **k):
            if "stored" not in seen:
                other_party_finishes()
            return real(*a, **k)

        monkeypatch.setattr(db.optuna, point, interleaved)
        caplog.set_level(logging.WARNING, logger="erase_tune.tune.run.record")
        # On the recorder's logger itself: an earlier CLI test in this process may have stopped
        # erase-tune's loggers from propagating to the root logger, where caplog listens.
        logger = logging.getLogger("erase_tune.tune.run.record")
        logger.addHandler(caplog.handler)
        try:
            rec.record(n, key, out, 1)  # must not raise UpdateFinishedTrialError
        finally:
            logger.removeHandler(caplog.handler)
        assert "stored" in seen, f"the driver never called {point}: the interleaving did not happen"
        monkeypatch.undo()

        stored = seen["stored"]
        assert stored[0] == (TrialState.FAIL if party == "stale" or outcome == "failed" else TrialState.COMPLETE)
        # (each record once: it reaches caplog through the recorder's logger and, when that
        # propagates, through the root logger too)
        # (the recorder's once-per-job note that these tiny trials re-read their batches is not the race's)
        lines = [m for m in {id(r): r.getMessage() for r in caplog.records
                             if r.name == "erase_tune.tune.run.record"}.values() if "read its batches" not in m]
        assert len(lines) == 1 and f"trial {n} " in lines[0], lines

        for again in range(2):  # the driver's own journal entry replayed later: still once
            with _fresh(storage_url) as fresh:
                fresh_rec = _driver(fresh)
                assert _snapshot(fresh, fresh_rec, n)[:5] == stored[:5]  # what the other party stored, unchanged
                if party == "replay":
                    assert _snapshot(fresh, fresh_rec, n)[5] == stored[5]
                trials = fresh_rec.study.get_trials()
                copies = [t for t in trials if t.user_attrs.get(REPLAYED_FROM) == n]
                if party == "stale" and outcome == "measured":
                    (copy,) = copies  # the measurement, stored once, as a new trial
                    assert copy.state == TrialState.COMPLETE
                    assert copy.values == pytest.approx(
                        objective_values(metric_attrs(out.result), SPACE.gain_over))
                    assert copy.user_attrs[Attr.PLAN_KEY] == key
                    assert len(trials) == 2
                    row = fresh.store.outcome(fresh_rec.job, copy.number)  # its samples, for status --trial
                    assert row is not None and row.status == "complete"
                    assert set(row.samples) == set(out.result.variants)
                else:
                    assert copies == [] and len(trials) == 1
                if again == 0:
                    fresh_rec.record(n, key, out, 1)
    finally:
        db.close()
        other_db.close()


class _fresh:
    """A third connection to the storage, closed after use."""

    def __init__(self, url: str) -> None:
        self.db = _open(url)

    def __enter__(self) -> Storage:
        return self.db

    def __exit__(self, *exc: object) -> None:
        self.db.close()


@pytest.mark.parametrize("moved_on", ["plan measured since", "target reached"])
def test_a_measurement_failed_as_stale_is_not_kept_once_the_study_moved_on(storage_url, moved_on, measured_outcome):
    """A driver paused past the grace period (SIGSTOP, a swapped-out VM) comes back with a
    measurement another driver failed as stale. Meanwhile the other driver went on: it measured
    the same plan again, or it filled the study to the job's target. Adding the measurement
    as a new trial would leave a plan measured twice, or more trials than ``--trials``: it is
    not kept, and the trial's row says why."""
    out = measured_outcome
    db, other_db = _open(storage_url), _open(storage_url)
    try:
        target = 1 if moved_on == "target reached" else 5
        job = db.store.create_job(study_name=NAME, space_path="ctr-smoke.yaml", space_yaml=SPACE.text,
                                  workload=SPACE.workload.name, n_trials_target=target, get_or_create=True)
        rec = Recorder(study=open_study(db, NAME), storage=db, job=job, space=SPACE)
        paused = rec.study.ask()
        key = PLAN.dumps()
        paused.set_user_attr(Attr.PLAN_KEY, key)
        db.optuna.record_heartbeat(rec.trial_id(paused.number))
        time.sleep(2.5)  # the paused driver's heartbeat is older than the grace period now
        other = _driver(other_db)
        optuna.storages.fail_stale_trials(other.study)
        assert other_db.trial(other.trial_id(paused.number)).state == TrialState.FAIL
        again = other.study.ask()  # the other driver carries on: the same plan, or another one
        other_plan = PLAN if moved_on == "plan measured since" else ErasePlan()
        other_key = other_plan.dumps()
        again.set_user_attr(Attr.PLAN, other_plan.to_dict())  # as the loop does
        again.set_user_attr(Attr.PLAN_KEY, other_key)
        other.record(again.number, other_key, dataclasses.replace(out, trial_number=again.number), 1)

        message = rec.record(paused.number, key, out, 1)  # the paused driver resumes

        assert "not kept" in message and ("measured since as trial" in message if moved_on == "plan measured since"
                                          else "holds its 1 measured trial(s)" in message), message
        with _fresh(storage_url) as fresh:
            fresh_rec = _driver(fresh)
            trials = fresh_rec.study.get_trials()
            assert [t.user_attrs.get(REPLAYED_FROM) for t in trials] == [None, None]  # no copy added
            assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE]
            row = fresh.store.outcome(fresh_rec.job, paused.number)
            assert row is not None and row.status == "failed" and "not kept" not in row.failure_reason
            assert ("measured since" if moved_on == "plan measured since" else "holds its 1") in row.failure_reason
    finally:
        db.close()
        other_db.close()
