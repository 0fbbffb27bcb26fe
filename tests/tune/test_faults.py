"""Trial faults are data, not the end of the job: a hung trial is timed out and its workers
killed, a NaN loss is a trial failure recorded once (with the worker's traceback), a dead
worker is an infrastructure failure retried on a fresh worker, and the study still ends with
the measured trials it was asked for; a job in which every trial fails exits non-zero."""

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


def _gone(pid: int, within_s: float = 15.0) -> bool:
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
    """mode -> how many trial runs played it."""
    played: dict[str, int] = {}
    for f in tickets.iterdir():
        mode = f.name.split("-", 1)[1]
        played[mode] = played.get(mode, 0) + 1
    return played


def test_hang_crash_and_nan_do_not_cost_the_target(ray_cluster, tmp_path, capsys):
    tickets = tmp_path / "tickets"
    tickets.mkdir()
    url = f"sqlite:///{tmp_path / 'faults.db'}"
    space = write_space(tmp_path / "faults.yaml", workload=FAULTY,
                        args={"mode": "ok,hang,crash,nan,ok", "tickets": str(tickets)},
                        budget={"timeout_s": 20}, trials=3)  # (a loaded machine's ok trial took 8 s)
    started = time.monotonic()
    assert run_cli("start", "--space", space, "--study", "faults", "--storage", url, "--no-confirm") == 0
    assert time.monotonic() - started < 120  # the hung trial did not hold the job up
    captured = capsys.readouterr()
    assert "study faults: 3 complete, 2 failed" in captured.out
    assert "retrying (attempt 2)" in captured.err  # the crash was retried
    # Every ticket ran once: the crash's trial ran again on a fresh worker (and played the next
    # ticket of the script); 3 trials measured, the hang and the nan failed once each.
    assert _tickets(tickets) == {"ok": 3, "hang": 1, "crash": 1, "nan": 1}

    study = optuna.load_study(study_name="faults", storage=url)
    trials = study.get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    failed = {t.number: t.user_attrs for t in trials if t.state == TrialState.FAIL}
    assert len(complete) == 3 and all(t.values is not None for t in complete)
    assert sorted(a["failure_kind"] for a in failed.values()) == ["trial", "trial"]
    reasons = sorted(a["failure_reason"] for a in failed.values())
    assert any(r == "timed out after 20s" for r in reasons) and any("nan" in r.lower() for r in reasons), reasons
    assert max(t.user_attrs.get("attempts", 1) for t in trials) == 2

    with Store(url) as store:
        job = store.get_job("faults")
        assert job.status == "finished"
        for number, attrs in failed.items():
            o = store.outcome(job, number)
            assert o.status == "failed" and o.failure_reason == attrs["failure_reason"]
        nan = next(n for n, a in failed.items() if "nan" in a["failure_reason"].lower())
        assert "Traceback" in store.outcome(job, nan).traceback  # the worker's own traceback came back

    # The hung trial's worker was killed, not left sleeping; the crashed one is gone too.
    for f in tickets.iterdir():
        if f.name.endswith(("-hang", "-crash")):
            assert _gone(int(f.read_text())), f"{f.name}: worker {f.read_text()} still alive"


def test_a_job_whose_every_trial_fails_exits_non_zero(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'nan.db'}"
    space = write_space(tmp_path / "nan.yaml", workload=FAULTY, args={"mode": "nan"}, trials=2)
    assert run_cli("start", "--space", space, "--study", "nan", "--storage", url, "--slots", 1) == 1
    err = capsys.readouterr().err
    assert "0 trials measured, 3 failed" in err and "erase-tune status --study nan" in err
    trials = optuna.load_study(study_name="nan", storage=url).get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL] * 3  # max(3, target) failures, then it stops
    with Store(url) as store:
        assert store.get_job("nan").status == "failed"

    # status reports the failures; export says there is nothing to export, in one line.
    assert run_cli("status", "--study", "nan", "--storage", url) == 0
    assert "3 failed" in capsys.readouterr().out
    assert run_cli("export", "--study", "nan", "--storage", url, "-o", tmp_path / "best.yaml") == 2
    err = capsys.readouterr().err
    assert err.startswith("erase-tune: error:") and "no complete trial" in err and err.count("\n") == 1
    assert not (tmp_path / "best.yaml").exists()


def test_a_package_the_workers_cannot_import_stops_the_job_at_once(ray_cluster, tmp_path, capsys):
    """The workers import the workload's module when they start: a package that did not
    travel to them is one line before any trial, not every trial failing."""
    pkg = tmp_path / "onlyhere"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from tests.tune.faulty import workload\n")
    url = f"sqlite:///{tmp_path / 'imp.db'}"
    space = write_space(tmp_path / "imp.yaml", workload="onlyhere:workload", trials=1)
    import sys

    sys.path.insert(0, str(tmp_path))  # the driver can import it; the Ray workers cannot
    try:
        assert run_cli("start", "--space", space, "--study", "imp", "--storage", url) == 2
    finally:
        sys.path.remove(str(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot import 'onlyhere'" in err[-1] and "--py-module" in err[-1]
