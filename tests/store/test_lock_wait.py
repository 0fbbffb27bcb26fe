"""The storage's own lock held by another process (a driver stopped with Ctrl-Z while setting
the storage up, or one stuck): the wait is said within two seconds and ends by the retry
setting, never a silent wait for good (issue 30)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from erase_tune.store.retry import RETRY_ENV
from erase_tune.store.storage import StorageLost, open_storage
from tests.tune.conftest import run_cli

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_held_sqlite_schema_lock_is_said_and_given_up_by_the_retry_setting(tmp_path, capsys, monkeypatch):
    db = tmp_path / "s.db"
    url = f"sqlite:///{db}"
    assert run_cli("db", "upgrade", "--storage", url) == 0
    capsys.readouterr()
    lock = tmp_path / f"s.db.{hashlib.sha256(b'schema').hexdigest()[:8]}.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv(RETRY_ENV, "2")
        t0 = time.monotonic()
        assert run_cli("db", "upgrade", "--storage", url) == 3  # was: waited for good, saying nothing
        took = time.monotonic() - t0
        assert run_cli("db", "current", "--storage", url) == 0  # a reader takes no lock
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    lines = capsys.readouterr().err.strip().splitlines()
    assert "another process holds its lock 'schema'" in lines[0] and "waiting up to 2s" in lines[0], lines
    assert lines[1].startswith(f"erase-tune: error: storage {url}: another process has held its lock 'schema'")
    assert 2 <= took < 6, took
    assert run_cli("db", "upgrade", "--storage", url) == 0  # released: taken at once


def test_a_held_postgres_lock_is_given_up_by_the_retry_setting(pg_url, monkeypatch):
    from erase_tune.store.storage import _lock
    from erase_tune.store.engine import parse_url

    assert open_storage(pg_url) is not None
    monkeypatch.setenv(RETRY_ENV, "1")
    key = int.from_bytes(hashlib.sha256(b"erase-tune:study:s").digest()[:8], "big", signed=True)
    other = create_engine(pg_url, poolclass=NullPool)
    db = open_storage(pg_url)
    try:
        with other.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            t0 = time.monotonic()
            with pytest.raises(StorageLost, match="another process has held its lock 'study:s' \\(a PostgreSQL"):
                with db.lock("study:s"):
                    pass
            assert time.monotonic() - t0 < 5
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
        with db.lock("study:s"):  # free again: taken at once
            pass
        with _lock(parse_url(pg_url), db.optuna.rdb.engine, "study:s"):
            pass
    finally:
        db.close()
        other.dispose()
