"""A systematic failure stops the job early: the baseline that cannot run stops it at its first
failure, and the first trials failing the same way (while none is measured) stop it after
:data:`SYSTEMATIC_FAILURES`, with one line naming the failure and a non-zero exit; trials that
fail for different reasons do not stop it, and what was measured stays stored."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState, create_trial

from erase_tune.store import Store
from erase_tune.store.storage import open_storage
from erase_tune.tune.run.loop import SYSTEMATIC_FAILURES, systematic_failure
from erase_tune.tune.search.study import Attr, open_study
from tests.tune.conftest import run_cli
from tests.tune.faulty import write_space

FAULTY = "tests.tune.faulty:workload"


def _failed(reason: str, plan: str) -> optuna.trial.FrozenTrial:
    return create_trial(state=TrialState.FAIL, user_attrs={Attr.FAILURE_KIND: "trial", Attr.FAILURE: reason,
                                                           Attr.PLAN_SUMMARY: plan})


def test_which_failures_are_systematic(tmp_path):
    url = f"sqlite:///{tmp_path / 'rules.db'}"
    study = open_study(open_storage(url), "rules")
    nan = "candidate: training loss became nan ({plan})"
    for plan in ("subarchs.0@s1", "subarchs.1@s1"):
        study.add_trial(_failed(nan.format(plan=plan), plan))
    assert systematic_failure(study) is None  # two alike: not yet
    # A third plan failing the same way (its own plan and numbers aside) is systematic.
    study.add_trial(_failed(nan.format(plan="subarchs.12@s1"), "subarchs.12@s1"))
    line = systematic_failure(study)
    assert line == f"the first {SYSTEMATIC_FAILURES} trials all failed the same way: " + nan.format(plan="subarchs.12@s1")

    # Different reasons are not systematic.
    other = open_study(open_storage(url), "mixed")
    for reason in ("timed out after 60s", "CUDA out of memory: tried to allocate 2 GiB", "timed out after 60s"):
        other.add_trial(_failed(reason, "p"))
    assert systematic_failure(other) is None

    # The baseline failing stops at once; a measured trial means nothing is systematic.
    base = open_study(open_storage(url), "base")
    base.add_trial(_failed("baseline: training loss became nan (no cuts; 0 side stream(s), blocking)", "x@s1"))
    assert systematic_failure(base).startswith("the baseline cannot run, so no trial can: baseline: training loss")
    base.add_trial(create_trial(state=TrialState.COMPLETE, values=[0.1, 0.0], user_attrs={Attr.PLAN: {}}))
    assert systematic_failure(base) is None


def test_every_trial_failing_alike_stops_after_the_threshold(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'alike.db'}"
    space = write_space(tmp_path / "alike.yaml", workload=FAULTY, args={"mode": "raise"}, trials=8)
    assert run_cli("start", "--space", space, "--study", "alike", "--storage", url, "--slots", 1) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"erase-tune: error: job alike: 0 trials measured, {SYSTEMATIC_FAILURES} failed: the first "
                       f"{SYSTEMATIC_FAILURES} trials all failed the same way: RuntimeError: planted failure: the "
                       f"workload cannot build its data (see: erase-tune status --study alike --storage '{url}')")
    trials = optuna.load_study(study_name="alike", storage=url).get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL] * SYSTEMATIC_FAILURES  # not 8 (the whole budget)
    with Store(url) as store:
        job = store.get_job("alike")
        assert job.status == "failed" and "all failed the same way" in job.error
    assert run_cli("status", "--study", "alike", "--storage", url) == 0
    assert f"{SYSTEMATIC_FAILURES} failed" in capsys.readouterr().out


def test_trials_failing_for_different_reasons_do_not_stop_the_job(ray_cluster, tmp_path, capsys):
    tickets = tmp_path / "tickets"
    tickets.mkdir()
    url = f"sqlite:///{tmp_path / 'mixed.db'}"
    space = write_space(tmp_path / "mixed.yaml", workload=FAULTY,
                        args={"mode": "raise,hang,raise", "tickets": str(tickets)},
                        # room for the good trial on a loaded machine: in four test workers on two
                        # cores it took over 15 s (the hang is timed out at this limit, so the test
                        # costs it once)
                        budget={"timeout_s": 40}, trials=4)
    assert run_cli("start", "--space", space, "--study", "mixed", "--storage", url, "--slots", 1, "--no-confirm") == 0
    assert "study mixed: 4 complete, 3 failed" in capsys.readouterr().out
    reasons = sorted(t.user_attrs[Attr.FAILURE] for t in optuna.load_study(study_name="mixed", storage=url).get_trials()
                     if t.state == TrialState.FAIL)
    assert len(reasons) == 3 and reasons[-1] == "timed out after 40s" and "planted failure" in reasons[0]
