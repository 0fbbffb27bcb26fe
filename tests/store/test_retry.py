"""Retries at the storage edge: every call through a Storage's Optuna storage and its Store is
retried while the storage is away, a write whose commit's answer was lost is handled as its
idempotence allows, and ``Storage.once()`` turns retries off for best-effort writes."""

from __future__ import annotations

import sqlite3

import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy.exc import OperationalError

from erase_tune.store.retry import RETRY_ENV, StorageBroken, StorageLost, UncertainCommit
from erase_tune.store.storage import open_storage


def _lost() -> OperationalError:
    return OperationalError("SELECT", {}, sqlite3.OperationalError("disk I/O error"))


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "1")
    storage = open_storage(f"sqlite:///{tmp_path / 'retry.db'}")
    yield storage
    storage.close()


def _flaky(monkeypatch, obj, name, failures: int, after=None):
    """``obj.name`` fails ``failures`` times (after running, when ``after`` says so), then works."""
    real, calls = getattr(obj, name), []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) <= failures:
            if after:
                real(*a, **k)  # the write is stored, its answer lost
            raise _lost()
        return real(*a, **k)

    monkeypatch.setattr(obj, name, flaky)
    return calls


def test_a_study_call_is_retried_at_the_edge(db, monkeypatch):
    study = optuna.create_study(storage=db.optuna, study_name="s", directions=["maximize", "minimize"])
    calls = _flaky(monkeypatch, db.optuna.rdb, "_get_trials", failures=2)
    trial = study.ask()
    assert [t.number for t in study.get_trials()] == [trial.number]
    assert len(calls) >= 3


def test_a_finish_whose_answer_was_lost_is_not_an_error(db, monkeypatch):
    study = optuna.create_study(storage=db.optuna, study_name="s", directions=["maximize", "minimize"])
    trial = study.ask()
    calls = _flaky(monkeypatch, db.optuna.rdb, "set_trial_state_values", failures=1, after=True)
    study.tell(trial, [1.0, 0.5])
    assert len(calls) == 2
    (stored,) = study.get_trials()
    assert stored.state == TrialState.COMPLETE and stored.values == [1.0, 0.5]
    with pytest.raises(Exception, match="finished"):  # a real second tell is still refused
        db.optuna.set_trial_state_values(stored._trial_id, TrialState.FAIL)


def test_a_storage_that_stays_away_is_one_storage_lost_line(db, monkeypatch):
    study = optuna.create_study(storage=db.optuna, study_name="s", directions=["maximize", "minimize"])
    _flaky(monkeypatch, db.optuna.rdb, "_get_trials", failures=10**6)
    with pytest.raises(StorageLost, match=r"^storage sqlite:///.*retry\.db lost while reading the study: disk I/O"):
        study.get_trials()


def test_once_tries_a_call_once(db, monkeypatch):
    study = optuna.create_study(storage=db.optuna, study_name="s", directions=["maximize", "minimize"])
    trial = study.ask()
    calls = _flaky(monkeypatch, db.optuna.rdb, "set_trial_state_values", failures=1)
    with db.once(), pytest.raises(OperationalError):
        study.tell(trial, state=TrialState.FAIL)
    assert len(calls) == 1
    study.tell(trial, state=TrialState.FAIL)  # retried again outside the block
    assert study.get_trials()[0].state == TrialState.FAIL


def test_stale_trials_are_failed_through_the_retrying_storage(tmp_path, monkeypatch):
    storage = open_storage(f"sqlite:///{tmp_path / 'stale.db'}", heartbeat_interval=1, grace_period=1)
    try:
        study = optuna.create_study(storage=storage.optuna, study_name="s", directions=["maximize", "minimize"])
        trial = study.ask()
        storage.optuna.record_heartbeat(trial._trial_id)
        import time

        time.sleep(2.5)
        optuna.storages.fail_stale_trials(study)
        assert study.get_trials()[0].state == TrialState.FAIL
    finally:
        storage.close()


def test_store_writes_retry_as_their_idempotence_allows(db, monkeypatch):
    from erase_tune.store import repo

    job = db.store.create_job(study_name="s", space_path="s.yaml", space_yaml="", workload="mlp", get_or_create=True)
    real_commit, failures = repo.Session.commit, []

    def commit_lost(self):  # the commit is made, its answer lost
        real_commit(self)
        if not failures:
            failures.append(1)
            raise _lost()

    monkeypatch.setattr(repo.Session, "commit", commit_lost)
    db.store.put_baseline("k", {"ne_baseline": 0.5}, {})  # an upsert: repeated safely
    assert db.store.get_baseline("k").metrics == {"ne_baseline": 0.5}
    failures.clear()
    with pytest.raises(StorageLost, match="lost while recording an export"):  # a plain insert: not repeated
        db.store.record_export(job, 0, "best.yaml", "plan")
    assert len(db.store.exports(job)) == 1
    failures.clear()
    again = db.store.create_job(study_name="s", space_path="s.yaml", space_yaml="", workload="mlp",
                                get_or_create=True)
    assert again.id == job.id


def test_an_uncertain_commit_is_a_sqlalchemy_error():
    from sqlalchemy.exc import SQLAlchemyError

    assert issubclass(UncertainCommit, SQLAlchemyError)  # code that catches storage errors still does


@pytest.mark.parametrize("message", ["no such table: trials", 'relation "trials" does not exist',
                                     "file is not a database"])
def test_an_error_no_wait_can_mend_is_a_loss_at_once_not_retried_as_unreachable(db, monkeypatch, message):
    monkeypatch.setenv(RETRY_ENV, "60")  # a retry would wait out this; the refusal comes at once
    study = optuna.create_study(storage=db.optuna, study_name="s", directions=["maximize", "minimize"])
    real, calls = db.optuna.rdb._get_trials, []

    def broken(*a, **k):
        calls.append(1)
        raise OperationalError("SELECT", {}, sqlite3.OperationalError(message))

    monkeypatch.setattr(db.optuna.rdb, "_get_trials", broken)
    with pytest.raises(StorageBroken) as e:
        study.get_trials()
    assert len(calls) == 1 and "\n" not in str(e.value) and isinstance(e.value, StorageLost)  # (exit 3, journal kept)
    assert str(e.value).startswith("storage sqlite:///") and message in str(e.value) and "not retried" in str(e.value)
    monkeypatch.setattr(db.optuna.rdb, "_get_trials", real)
    assert study.get_trials() == []
