"""A driver stopped from outside: killed with ``kill -9`` and followed at once by one that
finishes the job with nothing left RUNNING (Optuna's heartbeat fails the dead driver's trials
after the grace period), while the dead driver's private Ray does not outlive it; and SIGTERM,
to the driver or its whole process group, ending the job as interrupted within seconds.
(Split from test_resume.py: these run their own drivers as processes, a few minutes together.)"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from erase_tune.store import Store
from tests.tune.conftest import ROOT, cli
from tests.tune.faulty import write_space

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def _trials(url: str, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=url).get_trials()


def _count(db: Path, state: str) -> int:
    """Trials in ``state`` in a driver's SQLite file, read without writing to it: Optuna's
    ``load_study`` creates the schema it finds missing, and raced the driver making it
    (``UNIQUE constraint failed: alembic_version.version_num`` in the test's own read)."""
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
    except sqlite3.Error:  # no file yet
        return 0
    try:
        return conn.execute("SELECT COUNT(*) FROM trials WHERE state = ?", (state,)).fetchone()[0]
    except sqlite3.Error:  # no table yet, or the file is locked
        return 0
    finally:
        conn.close()


def _ray_processes_of(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_kill_9_then_rerun_finishes_with_nothing_running(tmp_path):
    """A driver (with its own local Ray) is killed mid-job; the same command, re-run at once,
    waits out the grace period, fails the dead driver's trials, runs what is missing and ends
    with exactly the target measured and no trial RUNNING. The dead driver's Ray processes
    are gone (no orphaned agents)."""
    url = f"sqlite:///{tmp_path / 'kill.db'}"
    space = write_space(tmp_path / "kill.yaml", workload="tests.tune.faulty:workload",
                        args={"mode": "ok", "train_batches": 64}, budget={"quality_steps": 40, "windows": 3},
                        trials=4)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ERASE_TUNE_JOURNAL_DIR": str(tmp_path / "journal")}
    argv = [sys.executable, "-m", "erase_tune", "start", "--space", str(space), "--study", "kill", "--storage", url,
            "--grace-period", "10", "--slots", "2", "--no-confirm"]
    driver = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline, running = time.monotonic() + 120, False
    while not running and time.monotonic() < deadline and driver.poll() is None:  # until a trial runs
        running = _count(tmp_path / "kill.db", "RUNNING") > 0
        time.sleep(0.3)
    time.sleep(1.0)
    ray_procs = _ray_processes_of(driver.pid)
    if not (running and ray_procs):
        driver.kill()
        pytest.fail(f"no trial ran with the driver's private local Ray (running={running}, Ray processes "
                    f"{len(ray_procs)}, driver exit {driver.poll()}): {driver.communicate(timeout=30)[1][-3000:]}")
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=30)
    _, alive = psutil.wait_procs(ray_procs, timeout=20)
    assert not alive, f"left behind: {[p.cmdline()[:2] for p in alive]}"
    running_before = [t.number for t in _trials(url, "kill") if t.state == TrialState.RUNNING]
    assert running_before
    # A trial whose outcome the dead driver had journaled but not yet stored (killed while
    # recording: a short trial's record is a good part of its cycle) is replayed, not failed.
    journaled = {int(p.stem.split("-")[1]) for p in (tmp_path / "journal").rglob("trial-*.pkl")}

    done = cli(*argv[3:], env={"ERASE_TUNE_JOURNAL_DIR": str(tmp_path / "journal")}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = _trials(url, "kill")
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    measured = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
    assert len(measured) == 4
    assert all(next(t for t in trials if t.number == n).state == (
        TrialState.COMPLETE if n in journaled else TrialState.FAIL) for n in running_before)
    with Store(url) as store:
        assert store.get_job("kill").status == "finished"


def test_sigterm_ends_the_job_as_interrupted_with_nothing_running(tmp_path):
    """What `timeout`, Kubernetes and `ray job stop` send: the driver cancels and fails its
    trials, marks the job interrupted and exits 143 (128 + SIGTERM), with one line and no stack."""
    url = f"sqlite:///{tmp_path / 'term.db'}"
    space = write_space(tmp_path / "term.yaml", workload="tests.tune.faulty:workload",
                        args={"mode": "ok", "train_batches": 64}, budget={"quality_steps": 60, "windows": 3},
                        trials=6)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ERASE_TUNE_JOURNAL_DIR": str(tmp_path / "journal")}
    driver = subprocess.Popen([sys.executable, "-m", "erase_tune", "start", "--space", str(space), "--study", "term",
                               "--storage", url, "--slots", "1", "--no-confirm"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _count(tmp_path / "term.db", "COMPLETE") == 0:
        time.sleep(0.3)
    driver.send_signal(signal.SIGTERM)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == "erase-tune: terminated by SIGTERM" and "Traceback" not in err
    assert not [t for t in _trials(url, "term") if t.state == TrialState.RUNNING]
    with Store(url) as store:
        assert store.get_job("term").status == "interrupted"


@pytest.mark.parametrize("moment", ["trials", "confirmation"])
def test_sigterm_to_the_whole_process_group_ends_the_job_within_seconds(tmp_path, moment):
    """`timeout`, a shell's job control and `kill -- -PGID` signal the driver's whole process
    group, the local Ray's own processes with it: Ray never answers the driver's clean-up
    again (each call waits a minute or more for a raylet that is gone). The job still ends
    within seconds, while trials run or while the front is confirmed: exit 143, one line, the
    job interrupted, nothing RUNNING."""
    url = f"sqlite:///{tmp_path / 'group.db'}"
    space = write_space(tmp_path / "group.yaml", workload="tests.tune.faulty:workload",
                        args={"mode": "ok", "train_batches": 64}, budget={"quality_steps": 60, "windows": 3},
                        trials=6 if moment == "trials" else 2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ERASE_TUNE_JOURNAL_DIR": str(tmp_path / "journal"),
           "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "erase_tune", "start", "--space", str(space), "--study", "group", "--storage", url,
            "--slots", "1", *(["--no-confirm"] if moment == "trials" else [])]
    driver = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)  # its own process group, Ray's processes in it
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(driver.stderr), daemon=True)
    reader.start()
    try:
        wait_for = "trial 0:" if moment == "trials" else "re-timing"
        deadline = time.monotonic() + 180
        while not any(wait_for in line for line in list(lines)):
            assert driver.poll() is None, "".join(lines)[-2000:]
            assert time.monotonic() < deadline, f"no {wait_for!r}: " + "".join(lines)[-2000:]
            time.sleep(0.1)
        os.killpg(driver.pid, signal.SIGTERM)
        sent = time.monotonic()
        driver.wait(timeout=90)
        took = time.monotonic() - sent
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    reader.join(timeout=10)
    err = "".join(lines)
    shown = err if len(err) < 6000 else f"{err[:3000]}\n[...]\n{err[-3000:]}"  # Ray's last words can be long
    assert driver.returncode == 143, shown
    assert took < 40, f"{took:.0f}s from SIGTERM to the exit"
    assert err.strip().splitlines()[-1] == "erase-tune: terminated by SIGTERM" and "Traceback" not in err, shown
    assert not [t for t in _trials(url, "group") if t.state == TrialState.RUNNING]
    with Store(url) as store:
        assert store.get_job("group").status == "interrupted"
