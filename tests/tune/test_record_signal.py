"""SIGTERM while the driver records a trial, sent deliberately right after a statement that
returns rows ran (its cursor still holds them): the driver's clean-up still marks the job
interrupted and fails what is in flight at once, and nothing stays RUNNING or locked.

(Sent by timing luck in the suite, SIGTERM to a driver's process group once left trial 0
RUNNING: the interrupted connection was closed with its statement unfinished, so SQLite kept
its transaction and write lock for as long as the exception's traceback held the cursor, and
the clean-up's writes waited out the 30-s busy timeout and failed.)"""

from __future__ import annotations

import dataclasses
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest
from optuna.trial import TrialState
from sqlalchemy import event

from erase_tune import _signals
from erase_tune.errors import Terminated
from erase_tune.store.storage import open_storage
from erase_tune.tune.execute.outcome import Failure, TrialOutcome, WorkerInfo
from erase_tune.tune.run.job import _Job, _mark_stopped, _set_up
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.space import SearchSpace
from tests.tune.faulty import write_space


@dataclasses.dataclass(eq=False)
class _Handle:
    spec: object
    submitted_at: float = dataclasses.field(default_factory=time.time)


class _Slots:
    """The executor's part the loop uses to admit a trial (the trial itself never runs here)."""

    slots, worker_start_s, describe = 1, 0.0, "one slot"

    def idle(self) -> int:
        return 1

    def submit(self, spec: object) -> _Handle:
        return _Handle(spec)

    def cancel(self, handle: _Handle, reason: str) -> None:
        pass


def _writable_at_once(path: Path) -> bool:
    conn = sqlite3.connect(path, timeout=0)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:  # database is locked
        return False
    finally:
        conn.close()


def test_sigterm_just_after_a_returning_write_leaves_nothing_running_or_locked(tmp_path, monkeypatch):
    monkeypatch.setenv("ERASE_TUNE_JOURNAL_DIR", str(tmp_path / "journal"))
    path = write_space(tmp_path / "s.yaml", trials=2)
    space = SearchSpace.load(path)
    db_path = tmp_path / "rec.db"
    db = open_storage(f"sqlite:///{db_path}")
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a Ray of this process has its own, which exits
    restore = _signals.on_signals()
    sent: list[str] = []

    def after(conn, cursor, statement, parameters, context, executemany):
        # The outcome row's upsert returns the row: its cursor holds it, unfetched, when the signal
        # is raised on the next line of Python (inside SQLAlchemy's execution, as a real one lands).
        if not sent and statement.startswith("INSERT INTO et_trial_outcomes") and "RETURNING" in statement:
            sent.append(statement)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        loop = _set_up(_Job(db=db, name="rec", space_path=str(path), target=2, executor=_Slots()), space,
                       check_space(space), lambda progress: None)
        assert loop.admit()
        (inflight,) = loop.inflight
        failed = TrialOutcome(trial_number=inflight.number, failure=Failure(kind="trial", reason="NaN loss"),
                              worker=WorkerInfo(node="n", pid=1))
        engine = db.optuna.rdb.engine
        event.listen(engine, "after_cursor_execute", after)
        try:
            with pytest.raises(Terminated) as stopped:
                loop.finish(inflight.handle, failed)
        finally:
            event.remove(engine, "after_cursor_execute", after)
        assert sent
        # The job's clean-up, as erase_tune.tune.run.job._run does it, while the exception (and
        # the traceback that held the interrupted cursor) is still alive.
        began = time.monotonic()
        _mark_stopped(db, "rec", stopped.value)
        loop.abort("interrupted")
        took = time.monotonic() - began
        assert _writable_at_once(db_path), "a write lock outlived the interrupted statement"
        assert took < 5, f"the clean-up waited {took:.0f}s for a lock"
    finally:
        restore()
        signal.signal(signal.SIGTERM, before)
    assert db.store.get_job("rec").status == "interrupted"
    assert [t.state for t in db.study("rec").get_trials()] == [TrialState.FAIL]
    db.close()
