"""Trial faults are data, not the end of the job: a hung trial is timed out and its worker
killed, a dead worker and a NaN loss are recorded as failed trials with their reasons (in
the study and in ``et_trial_measurements``), and the other trials run and complete."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import psutil
from optuna.trial import TrialState

from erase_tune.store import Store
from tests.tune.conftest import run_cli
from tests.tune.faulty import write_space

FAULTY = "tests.tune.faulty:workload"


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def _tickets(tickets: Path) -> dict[str, int]:
    """mode -> how many trials played it."""
    played: dict[str, int] = {}
    for f in tickets.iterdir():
        mode = f.name.split("-", 1)[1]
        played[mode] = played.get(mode, 0) + 1
    return played


def test_hang_crash_and_nan_fail_while_the_job_goes_on(ray_cluster, tmp_path, capsys):
    tickets = tmp_path / "tickets"
    tickets.mkdir()
    url = f"sqlite:///{tmp_path / 'faults.db'}"
    space = write_space(tmp_path / "faults.yaml", workload=FAULTY,
                        args={"mode": "ok,hang,crash,nan,ok", "tickets": str(tickets)},
                        budget={"timeout_s": 8}, trials=5)
    started = time.monotonic()
    assert run_cli("start", "--space", space, "--study", "faults", "--storage", url) == 0
    assert time.monotonic() - started < 60  # the hung trial did not hold the job up
    assert "study faults: 2 complete, 3 failed" in capsys.readouterr().out
    assert _tickets(tickets) == {"ok": 2, "hang": 1, "crash": 1, "nan": 1}  # every trial ran once

    trials = optuna.load_study(study_name="faults", storage=url).get_trials()
    assert len(trials) == 5
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    failed = {t.number: t.user_attrs["failure_reason"] for t in trials if t.state == TrialState.FAIL}
    assert len(complete) == 2 and all(t.values is not None and "metrics" in t.user_attrs for t in complete)
    assert len(failed) == 3, failed
    reasons = sorted(failed.values())
    hung = [r for r in reasons if r == "timed out after 8s"]
    died = [r for r in reasons if r.startswith("worker died")]
    nan = [r for r in reasons if "loss" in r and "nan" in r]
    assert (len(hung), len(died), len(nan)) == (1, 1, 1), reasons

    with Store(url) as store:
        job = store.get_job("faults")
        assert job.status == "finished"
        rows = {r.trial_number: r for r in store.trial_measurements(job)}
    assert sorted(rows) == [t.number for t in trials]
    for number, reason in failed.items():
        assert rows[number].status == "failed" and rows[number].failure_reason == reason
    for t in complete:
        assert rows[t.number].status == "complete" and rows[t.number].failure_reason is None

    # The hung trial's worker was killed, not left sleeping; the crashed one is gone too.
    for f in tickets.iterdir():
        if f.name.endswith(("-hang", "-crash")):
            assert _gone(int(f.read_text())), f"{f.name}: worker {f.read_text()} still alive"


def test_a_job_whose_every_trial_dies_still_finishes(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    space = write_space(tmp_path / "crash.yaml", workload=FAULTY, args={"mode": "crash"}, trials=2)
    assert run_cli("start", "--space", space, "--study", "crash", "--storage", url) == 0
    out = capsys.readouterr().out
    assert "study crash: 0 complete, 2 failed" in out and "worker died" in out

    trials = optuna.load_study(study_name="crash", storage=url).get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL] * 2
    assert all(t.user_attrs["failure_reason"].startswith("worker died") for t in trials)
    with Store(url) as store:
        assert store.get_job("crash").status == "finished"

    # status reports the failures; export says there is nothing to export, in one line.
    assert run_cli("status", "--study", "crash", "--storage", url) == 0
    assert "2 failed" in capsys.readouterr().out
    assert run_cli("export", "--study", "crash", "--storage", url, "-o", tmp_path / "best.yaml") == 2
    err = capsys.readouterr().err
    assert err.startswith("erase-tune: error:") and "no complete trial" in err and err.count("\n") == 1
    assert not (tmp_path / "best.yaml").exists()

