"""Several drivers, one study: the target is the study's, no plan is measured twice, and
schema set-up is safe when drivers start at the same moment on a fresh database.

The load tests (marker ``load``, run with ``ERASE_TUNE_LOAD_TESTS=1``) start three drivers that
share one Ray cluster of two CPUs, one waiting for the others' CPUs (30 s); and (about 8 minutes
on two cores) three drivers beside two CPU-burning processes, so the drivers, their private
local Rays, their trial workers and PostgreSQL all compete for the machine: the load under
which drivers once raced on a finished trial."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from erase_tune.store import Store
from tests.tune.conftest import ROOT
from tests.tune.faulty import write_space


def _drivers(n: int, argv: list[str], tmp_path) -> list[subprocess.CompletedProcess]:
    # The drivers wait for each other's study lock: with the service tests' 3 s storage retry, a
    # driver whose lock-holding neighbour ran slow on a loaded machine gave up (exit 3). 60 s is
    # erase-tune's own default.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ERASE_TUNE_JOURNAL_DIR": str(tmp_path / "journal"),
           "ERASE_TUNE_STORAGE_RETRY_S": "60"}
    procs = [subprocess.Popen([sys.executable, "-m", "erase_tune", *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=600), *p.communicate()) for p in procs]


def test_three_drivers_share_one_postgres_study(pg_url, tmp_path):
    """3 drivers x 2 trial slots (each its own local Ray), 12 trials, started at once on an
    empty database: exactly 12 measured, no plan measured twice, unique numbers, every
    outcome stored."""
    space = write_space(tmp_path / "many.yaml", cuts={"candidates": ["subarchs.0", "subarchs.1", "subarchs.2",
                                                                     "subarchs.3"], "max_streams": 1},
                        sampler={"name": "tpe", "seed": 0}, trials=12)
    done = _drivers(3, ["start", "--space", str(space), "--study", "many", "--storage", pg_url, "--slots", "2",
                        "--no-confirm"], tmp_path)
    for d in done:
        assert d.returncode == 0, d.stderr[-3000:]
    trials = optuna.load_study(study_name="many", storage=pg_url).get_trials()
    assert len({t.number for t in trials}) == len(trials)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    measured = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
    assert len(measured) == 12
    keys = [t.user_attrs["plan_key"] for t in measured]
    assert len(set(keys)) == 12, "a plan was measured twice"
    with Store(pg_url) as store:
        job = store.get_job("many")
        assert job.status == "finished"
        assert all(store.outcome(job, t.number).status == "complete" for t in measured)


def test_two_drivers_on_one_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    space = write_space(tmp_path / "two.yaml", trials=4)
    done = _drivers(2, ["start", "--space", str(space), "--study", "two", "--storage", url, "--slots", "1",
                        "--no-confirm"], tmp_path)
    for d in done:
        assert d.returncode == 0, d.stderr[-3000:]
    trials = optuna.load_study(study_name="two", storage=url).get_trials()
    measured = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
    assert len(measured) == 4 and len({t.user_attrs["plan_key"] for t in measured}) == 4
    assert not [t for t in trials if t.state == TrialState.RUNNING]


@contextlib.contextmanager
def cpu_burners(n: int = 2) -> Iterator[None]:
    """``n`` processes spinning on the CPU for as long as the block runs."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


@pytest.mark.load
def test_three_drivers_beside_cpu_burners(pg_url, tmp_path):
    """3 drivers (each its own local Ray) and 6 trials, started at once on an empty database
    beside two CPU burners on a two-core machine: every driver exits 0 without a traceback,
    exactly 6 measured, no plan measured twice, and the outcomes stored as complete are exactly
    the trials Optuna holds as measured (none lost, none recorded for a trial another driver
    or the reaper had already finished). The trial limit allows for the load: a trial of
    seconds takes minutes here."""
    space = write_space(tmp_path / "load.yaml", cuts={"candidates": ["subarchs.0", "subarchs.1", "subarchs.2",
                                                                     "subarchs.3"], "max_streams": 1},
                        sampler={"name": "tpe", "seed": 0}, trials=6, budget={"timeout_s": 600})
    with cpu_burners(2):
        done = _drivers(3, ["start", "--space", str(space), "--study", "load", "--storage", pg_url, "--slots", "1",
                            "--no-confirm"], tmp_path)
    for d in done:
        assert d.returncode == 0, d.stderr[-3000:]
        assert "Traceback" not in d.stderr, d.stderr[-3000:]
    trials = optuna.load_study(study_name="load", storage=pg_url).get_trials()
    assert len({t.number for t in trials}) == len(trials)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    measured = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
    assert len(measured) == 6 and len({t.user_attrs["plan_key"] for t in measured}) == 6
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT trial_number, status FROM et_trial_outcomes")).all()
    engine.dispose()
    assert sorted(n for n, status in rows if status == "complete") == sorted(t.number for t in measured), rows


@pytest.mark.load
def test_three_drivers_share_one_two_cpu_ray_cluster(pg_url, tmp_path):
    """3 drivers of one study join one Ray cluster of 2 CPUs (``ray start --head``) with a trial
    slot of 1 CPU each: two run, the third waits for a CPU (and says so within seconds, not after
    the 30 s a slow start is given) until a slot is given back; every driver exits 0 without a
    traceback, exactly the study's 4 trials are measured, no plan twice, and no CPU stays held
    once they are gone."""
    from tests.tune.test_ray_cluster import ENV, _free_port, _ray_start

    port = _free_port()
    head = _ray_start(["--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false"], tmp_path / "head.log")
    gcs = f"127.0.0.1:{port}"
    try:
        code = "import ray; ray.init(address=%r, logging_level='error'); print(ray.cluster_resources().get('CPU'))"
        deadline = time.monotonic() + 180
        while subprocess.run([sys.executable, "-c", code % gcs], env=ENV, capture_output=True, text=True,
                             timeout=120).stdout.strip().splitlines()[-1:] != ["2.0"]:
            assert head.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(1)
        space = write_space(tmp_path / "shared.yaml", trials=4, budget={"timeout_s": 300})
        env = {**ENV, "ERASE_TUNE_JOURNAL_DIR": str(tmp_path / "journal")}
        argv = [sys.executable, "-m", "erase_tune", "start", "--space", str(space), "--study", "shared", "--storage",
                pg_url, "--ray-address", gcs, "--slots", "1", "--no-confirm"]
        procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(3)]
        done = [(p.wait(timeout=600), *p.communicate()) for p in procs]
        for rc, out, err in done:
            assert rc == 0 and "Traceback" not in err, err[-3000:]
        said = [re.search(r"waiting for 1 CPU\(s\) on one node to start trial workers \((\d+)s of at most", err)
                for _, _, err in done]
        assert any(said) and all(int(m.group(1)) <= 10 for m in said if m), [err for _, _, err in done]
        trials = optuna.load_study(study_name="shared", storage=pg_url).get_trials()
        assert not [t for t in trials if t.state == TrialState.RUNNING]
        measured = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
        assert len(measured) == 4 and len({t.user_attrs["plan_key"] for t in measured}) == 4
        code = "import ray; ray.init(address=%r, logging_level='error'); print(ray.available_resources().get('CPU'))"
        free = subprocess.run([sys.executable, "-c", code % gcs], env=ENV, capture_output=True, text=True, timeout=120)
        assert free.stdout.strip().splitlines()[-1:] == ["2.0"], free.stdout + free.stderr
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the whole group: raylet, GCS, workers
        head.wait(timeout=30)
        current = Path("/tmp/ray/ray_current_cluster")  # (what `ray start` left for address="auto")
        if current.exists():
            current.unlink()
