"""Storage lost mid-job: the driver stops with one line naming the storage (password
redacted) and exit code 3, its Ray work is cancelled, and the outcomes it measured but
could not store are kept in the local journal and replayed by the next ``start``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import optuna
from optuna.trial import TrialState
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from tests.conftest import PG_ADMIN_URL
from tests.tune.conftest import ROOT, cli
from tests.tune.faulty import write_space


def _start(argv: list[str], tmp_path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ERASE_TUNE_JOURNAL_DIR": str(tmp_path / "journal"),
           "ERASE_TUNE_STORAGE_RETRY_S": "3"}
    return subprocess.Popen([sys.executable, "-m", "erase_tune", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _read_only(path, on: bool) -> None:
    """Make a file read-only for its owner, root included (root ignores permission bits:
    the immutable attribute binds it too)."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True)
    else:
        path.chmod(0o444 if on else 0o644)


def _journal(tmp_path) -> list:
    return sorted((tmp_path / "journal").rglob("trial-*.pkl"))


IN_FLIGHT = text(
    "SELECT t.state, EXISTS (SELECT 1 FROM trial_user_attributes a WHERE a.trial_id = t.trial_id AND a.key = 'plan_key') "
    "FROM trials t JOIN studies s ON s.study_id = t.study_id WHERE s.study_name = :study")


def _wait_for_trials(url: str, study: str, complete: int, within: float = 180) -> None:
    """Until ``complete`` trials are stored and the next one is running with its plan stored (in
    flight: between Optuna's ask and the plan's write, a storage lost has nothing measured to keep).

    Read with one query on one engine: Optuna's ``load_study`` would set up a storage at every
    poll (its tables created in a database the driver may still be setting up, and its migration
    scripts parsed: a tenth of a core at three polls a second)."""
    path = make_url(url).database if url.startswith("sqlite") else None
    engine = create_engine(url, poolclass=NullPool)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if path is None or os.path.exists(path):  # (connecting would create the file)
                try:
                    with engine.connect() as conn:
                        rows = conn.execute(IN_FLIGHT, {"study": study}).all()
                    if sum(state == "COMPLETE" for state, _ in rows) >= complete and any(
                            state == "RUNNING" and planned for state, planned in rows):
                        return
                except DBAPIError:  # the driver has not made the tables yet
                    pass
            time.sleep(0.3)
    finally:
        engine.dispose()
    raise AssertionError(f"{study}: {complete} trials did not complete in {within}s")


def test_sqlite_file_made_read_only_mid_job(tmp_path):
    db = tmp_path / "ro.db"
    url = f"sqlite:///{db}"
    space = write_space(tmp_path / "ro.yaml", workload="tests.tune.faulty:workload",
                        args={"mode": "ok", "train_batches": 64}, budget={"quality_steps": 60, "windows": 3},
                        trials=6)
    argv = ["start", "--space", str(space), "--study", "ro", "--storage", url, "--slots", "1", "--no-confirm"]
    driver = _start(argv, tmp_path)
    _wait_for_trials(url, "ro", 1)
    _read_only(db, True)
    try:
        out, err = driver.communicate(timeout=180)
    finally:
        _read_only(db, False)
    assert driver.returncode == 3, err[-3000:]
    lines = [line for line in err.strip().splitlines() if line.startswith("erase-tune: error:")]
    assert len(lines) == 1 and "storage sqlite:///" in lines[0] and "readonly" in lines[0].replace(" ", "")
    assert "Traceback" not in err
    kept = _journal(tmp_path)
    assert kept, "the measured but unstored outcome is in the journal"

    done = cli(*argv, env={"ERASE_TUNE_JOURNAL_DIR": str(tmp_path / "journal")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert not _journal(tmp_path)
    trials = optuna.load_study(study_name="ro", storage=url).get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert sum(t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs for t in trials) == 6


def test_postgres_database_dropped_mid_job(pg_database, tmp_path):
    name = f"et_drop_{os.getpid()}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = make_url(PG_ADMIN_URL).set(database=name, password="hunter2").render_as_string(hide_password=False)
    space = write_space(tmp_path / "pg.yaml", workload="tests.tune.faulty:workload",
                        args={"mode": "ok", "train_batches": 64}, budget={"quality_steps": 60, "windows": 3},
                        trials=6)
    driver = _start(["start", "--space", str(space), "--study", "pg", "--storage", url, "--slots", "1",
                     "--no-confirm"], tmp_path)
    try:
        _wait_for_trials(url, "pg", 1)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
        out, err = driver.communicate(timeout=180)
        assert driver.returncode == 3, err[-3000:]
        lines = [line for line in err.strip().splitlines() if line.startswith("erase-tune: error:")]
        assert len(lines) == 1 and f"/{name}" in lines[0] and "***" in lines[0]
        assert "hunter2" not in out + err and "Traceback" not in err
    finally:
        driver.kill() if driver.poll() is None else None
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def test_losing_postgres_while_holding_the_study_lock_reports_the_loss(tmp_path, monkeypatch):
    """The race the end-to-end test above can hit: the database goes while a driver holds the
    study's advisory lock. Releasing the lock on the dead connection must not replace the
    storage-loss error with a raw driver error (a traceback from the CLI), and taking the lock
    on a storage that is gone is a StorageLost like any other storage call."""
    import pytest

    from erase_tune.store.storage import RETRY_ENV, StorageLost, open_storage

    monkeypatch.setenv(RETRY_ENV, "1")
    name = f"et_lock_{os.getpid()}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    db = open_storage(make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False))
    try:
        with pytest.raises(StorageLost, match="lost while counting"):
            with db.lock("study:s"):
                with admin.connect() as conn:
                    conn.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
                raise StorageLost(f"storage {db.url} lost while counting the study's trials: gone")
        with pytest.raises(StorageLost, match="lost while taking the lock 'study:s'"):
            with db.lock("study:s"):
                pass
    finally:
        db.close()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def test_sqlite_busy_while_opening_is_waited_out_other_errors_are_not(tmp_path, monkeypatch):
    """Another process opening the same SQLite file at the moment a driver sets it up can make
    set-up fail at once with "database is locked", or find a table the other created a moment
    before ("table alembic_version already exists"; both seen in CI: a poller's Optuna created
    its tables meanwhile); open_storage retries those, and only those, within the retry window."""
    import sqlite3

    import pytest
    from sqlalchemy.exc import OperationalError

    import erase_tune.store.storage as storage
    from erase_tune.errors import EraseTuneError

    real, calls = storage._open_once, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise OperationalError("BEGIN", {}, sqlite3.OperationalError("database is locked"))
        if len(calls) == 2:
            raise OperationalError("CREATE TABLE alembic_version", {},
                                   sqlite3.OperationalError("table alembic_version already exists"))
        return real(*a, **k)

    monkeypatch.setattr(storage, "_open_once", flaky)
    db = storage.open_storage(f"sqlite:///{tmp_path / 'busy.db'}")
    db.close()
    assert len(calls) == 3

    def broken(*a, **k):
        calls.append(1)
        raise OperationalError("BEGIN", {}, sqlite3.OperationalError("disk I/O error"))

    calls.clear()
    monkeypatch.setattr(storage, "_open_once", broken)
    with pytest.raises(EraseTuneError, match="cannot open: disk I/O error"):
        storage.open_storage(f"sqlite:///{tmp_path / 'io.db'}")
    assert len(calls) == 1
