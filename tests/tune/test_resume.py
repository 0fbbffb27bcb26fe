"""Resuming a job: ``--trials`` is the study's total, a repeat of a measured plan is answered
without running it, a study of another workload is refused, and a driver killed with
``kill -9`` is followed at once by one that finishes the job with nothing left RUNNING
(Optuna's heartbeat fails the dead driver's trials after the grace period), while the dead
driver's private Ray does not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import psutil
import pytest
import sqlalchemy.exc
from optuna.trial import TrialState

from erase_tune.store import Store
from tests.tune.conftest import ROOT, cli, run_cli
from tests.tune.faulty import write_space

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def _trials(url: str, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=url).get_trials()


def test_more_trials_resume_the_same_job(storage_url, ray_cluster, tmp_path, capsys):
    tickets = tmp_path / "tickets"
    tickets.mkdir()
    space = write_space(tmp_path / "grow.yaml", workload="tests.tune.faulty:workload",
                        args={"mode": "ok", "tickets": str(tickets)})
    assert run_cli("start", "--space", space, "--study", "grow", "--trials", 3, "--storage", storage_url,
                   "--no-confirm") == 0
    assert [t.state for t in _trials(storage_url, "grow")] == [TrialState.COMPLETE] * 3
    assert run_cli("start", "--space", space, "--study", "grow", "--trials", 5, "--storage", storage_url,
                   "--no-confirm") == 0
    assert "study grow: 5 complete, 0 failed" in capsys.readouterr().out

    trials = _trials(storage_url, "grow")
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    # The resumed driver has its own sampler seed: new plans, not the first run's again.
    assert len({t.user_attrs["plan_key"] for t in trials}) == 5
    assert len(list(tickets.iterdir())) == 5  # five trials ran in workers, not three
    # The baseline's NE was measured by the first trials and then read from the cache: the
    # resumed driver read it from the stored cache, it did not train the baseline again.
    with Store(storage_url) as store:
        jobs = store.list_jobs()
        assert [j.study_name for j in jobs] == ["grow"]
        assert jobs[0].status == "finished" and jobs[0].n_trials_target == 5
        cached = [store.outcome(jobs[0], n).provenance["baseline_ne_cached"] for n in range(5)]
    assert cached[0] is False and cached[3] is True and cached[4] is True

    # Asking for what the study already holds runs nothing and leaves the job finished.
    assert run_cli("start", "--space", space, "--study", "grow", "--trials", 5, "--storage", storage_url,
                   "--no-confirm") == 0
    assert len(_trials(storage_url, "grow")) == 5 and len(list(tickets.iterdir())) == 5


def test_a_repeat_of_a_measured_plan_is_not_run_again(ray_cluster, tmp_path, capsys):
    """One candidate, two side streams, fixed λ: the space holds three plans (no cut, the cut
    on the main stream, the cut on a side stream, whichever id), so the study cannot hold four
    measured trials: the sampler keeps proposing known plans, which are answered from the
    earlier trial, and the job ends when the space is exhausted."""
    tickets = tmp_path / "tickets"
    tickets.mkdir()
    url = f"sqlite:///{tmp_path / 'dup.db'}"
    space = write_space(
        tmp_path / "dup.yaml", workload="tests.tune.faulty:workload", args={"mode": "ok", "tickets": str(tickets)},
        cuts={"candidates": ["subarchs.0"], "max_streams": 2, "aux_weight": 1.0},
        seeds=[{"name": "on-stream-1", "plan": {"num_streams": 1, "cuts": [{"module": "subarchs.0", "stream": 1}]}},
               {"name": "on-stream-2", "plan": {"num_streams": 2, "cuts": [{"module": "subarchs.0", "stream": 2}]}}],
    )
    assert run_cli("start", "--space", space, "--study", "dup", "--trials", 4, "--slots", 1, "--storage", url,
                   "--no-confirm") == 0
    captured = capsys.readouterr()
    assert "space exhausted" in captured.out + captured.err
    trials = _trials(url, "dup")
    first_of: dict[str, optuna.trial.FrozenTrial] = {}
    for t in trials:
        key = t.user_attrs["plan_key"]
        if key not in first_of:
            first_of[key] = t
            assert "duplicate_of" not in t.user_attrs and t.state == TrialState.COMPLETE
            continue
        earlier = first_of[key]
        assert t.user_attrs["duplicate_of"] == earlier.number and t.values == earlier.values
    assert len(first_of) == 3 and trials[0].user_attrs["seed_name"] == "on-stream-1"
    assert len(list(tickets.iterdir())) == 3  # only distinct plans ran in a worker


def test_resuming_with_another_workload_is_refused(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'wl.db'}"
    first = write_space(tmp_path / "first.yaml", trials=1)
    assert run_cli("start", "--space", first, "--study", "wl", "--storage", url, "--no-confirm") == 0
    other = write_space(tmp_path / "other.yaml", args={"width": 24}, trials=2)
    capsys.readouterr()
    assert run_cli("start", "--space", other, "--study", "wl", "--storage", url) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "with other arguments" in err[0] and "use another study name" in err[0]
    assert len(_trials(url, "wl")) == 1  # nothing ran, nothing lost


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
        if os.path.exists(tmp_path / "kill.db"):
            try:
                running = any(t.state == TrialState.RUNNING for t in _trials(url, "kill"))
            except (KeyError, sqlalchemy.exc.OperationalError):  # no study yet, or its schema half made
                pass
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
    while time.monotonic() < deadline:
        try:
            if any(t.state == TrialState.COMPLETE for t in _trials(url, "term")):
                break
        except (KeyError, Exception):  # noqa: BLE001 - not created yet
            pass
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
    assert driver.returncode == 143, err[-2000:]
    assert took < 40, f"{took:.0f}s from SIGTERM to the exit"
    assert err.strip().splitlines()[-1] == "erase-tune: terminated by SIGTERM" and "Traceback" not in err, err[-2000:]
    assert not [t for t in _trials(url, "group") if t.state == TrialState.RUNNING]
    with Store(url) as store:
        assert store.get_job("group").status == "interrupted"
