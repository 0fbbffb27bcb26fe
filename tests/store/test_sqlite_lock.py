"""A SQLite file another process holds locked: the command says at once what it waits for and
waits as long as the retry setting says, not SQLite's own silent busy wait. Real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "erase_tune", *args], capture_output=True, text=True, timeout=120,
                          check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_a_locked_sqlite_file_is_waited_for_out_loud_and_by_the_retry_setting(tmp_path):
    db = tmp_path / "locked.db"
    url = f"sqlite:///{db}"
    assert _cli("db", "upgrade", "--storage", url).returncode == 0
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        out = _cli("status", "--storage", url, ERASE_TUNE_STORAGE_RETRY_S="3")
        took = time.monotonic() - started
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert out.returncode == 3 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert "unreachable while" in lines[0] and "database is locked" in lines[0] and "retrying for up to 3s" in lines[0]
    assert lines[-1].startswith(f"erase-tune: error: storage {url} lost while") and lines[-1].endswith("database is locked")
    # SQLite's own busy wait was 30 s of silence before the retries even began; now the retry
    # setting (3 s) bounds the wait (the rest is the interpreter's start).
    assert took < 28, took


def test_db_current_on_a_locked_file_is_waited_for_and_one_line(tmp_path):
    """Was: an OperationalError traceback ('database is locked' on BEGIN IMMEDIATE), at once."""
    db = tmp_path / "locked.db"
    url = f"sqlite:///{db}"
    assert _cli("db", "upgrade", "--storage", url).returncode == 0
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        out = _cli("db", "current", "--storage", url, ERASE_TUNE_STORAGE_RETRY_S="2")
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert "unreachable while reading the schema's revision" in lines[0] and "retrying for up to 2s" in lines[0]
    assert lines[-1].endswith("lost while reading the schema's revision: database is locked"), lines


def test_db_upgrade_on_a_locked_file_waits_by_the_retry_setting_saying_so(tmp_path):
    """Was: 'database upgrade failed ...: database is locked' after SQLite's own busy timeout,
    the storage's retry window ignored (a migration's error was not seen as the lock it was)."""
    db = tmp_path / "locked.db"
    url = f"sqlite:///{db}"
    assert _cli("db", "upgrade", "--storage", url).returncode == 0
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.monotonic()
        out = _cli("db", "upgrade", "--storage", url, ERASE_TUNE_STORAGE_RETRY_S="4")
        took = time.monotonic() - started
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert "database is locked" in lines[0] and "waiting up to" in lines[0], lines
    assert lines[-1].startswith("erase-tune: error: ") and lines[-1].endswith("database is locked"), lines
    assert took >= 4, took
