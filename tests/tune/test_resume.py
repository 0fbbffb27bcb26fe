"""Resuming a job: ``--trials`` is a total, stale trials of a dead driver are failed (a live
driver's are not), and a plan the study already measured is answered without running it."""

from __future__ import annotations

import time

import optuna
import pytest
from optuna.trial import TrialState

from erase_tune.store import Store
from erase_tune.tune.driver import STALE_AFTER_S
from erase_tune.tune.study import make_sampler, open_study
from tests.tune.conftest import run_cli
from tests.tune.faulty import write_space

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def _trials(url: str, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=url).get_trials()


def test_more_trials_resume_the_same_job(storage_url, ray_cluster, tmp_path, capsys):
    tickets = tmp_path / "tickets"
    tickets.mkdir()
    space = write_space(tmp_path / "grow.yaml", workload="tests.tune.faulty:workload",
                        args={"mode": "ok", "tickets": str(tickets)})
    assert run_cli("start", "--space", space, "--study", "grow", "--trials", 3, "--storage", storage_url) == 0
    assert [t.state for t in _trials(storage_url, "grow")] == [TrialState.COMPLETE] * 3
    assert run_cli("start", "--space", space, "--study", "grow", "--trials", 5, "--storage", storage_url) == 0
    assert "study grow: 5 complete, 0 failed" in capsys.readouterr().out

    trials = _trials(storage_url, "grow")
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    assert all(t.state == TrialState.COMPLETE for t in trials)
    # The resumed run proposes new plans; it does not replay the first run's proposals.
    assert len({t.user_attrs["plan_key"] for t in trials}) == 5
    assert not any("duplicate_of" in t.user_attrs for t in trials)
    assert len(list(tickets.iterdir())) == 5  # five trials ran in workers, not three

    with Store(storage_url) as store:
        jobs = store.list_jobs()
        assert [j.study_name for j in jobs] == ["grow"]
        assert jobs[0].status == "finished" and jobs[0].finished_at is not None
        assert jobs[0].n_trials_target == 5  # the resume's target, not the first run's
        assert [r.trial_number for r in store.trial_measurements(jobs[0])] == [0, 1, 2, 3, 4]

    # Asking for what the study already holds runs nothing and leaves the job finished.
    assert run_cli("start", "--space", space, "--study", "grow", "--trials", 5, "--storage", storage_url) == 0
    assert len(_trials(storage_url, "grow")) == 5 and len(list(tickets.iterdir())) == 5
    with Store(storage_url) as store:
        assert store.get_job("grow").status == "finished"


def test_stale_trials_are_failed_and_live_ones_left_alone(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'stale.db'}"
    space = write_space(tmp_path / "stale.yaml")
    study = open_study(url, "stale", sampler=make_sampler("random", 0))
    dead = study.ask()  # its driver died long ago
    dead.set_user_attr("heartbeat", time.time() - 10 * STALE_AFTER_S)
    live = study.ask()  # another driver, still beating
    live.set_user_attr("heartbeat", time.time())
    just_asked = study.ask()  # another driver, between ask() and its first heartbeat

    assert run_cli("start", "--space", space, "--study", "stale", "--trials", 3, "--storage", url) == 0
    out = capsys.readouterr().out
    assert f"trial {dead.number}: stale" in out
    assert f"trial {live.number}: stale" not in out and f"trial {just_asked.number}: stale" not in out

    by_number = {t.number: t for t in _trials(url, "stale")}
    assert by_number[dead.number].state == TrialState.FAIL
    assert by_number[dead.number].user_attrs["failure_reason"].startswith("stale")
    assert by_number[live.number].state == TrialState.RUNNING
    assert by_number[just_asked.number].state == TrialState.RUNNING
    # The stale failure counts toward --trials 3: two more trials ran.
    new = [t for n, t in by_number.items() if n not in (dead.number, live.number, just_asked.number)]
    assert len(new) == 2 and all(t.state == TrialState.COMPLETE for t in new)

    # The "other drivers" finish their trials; the study is then all finished.
    study.tell(live, state=TrialState.FAIL)
    study.tell(just_asked, state=TrialState.FAIL)
    assert all(t.state.is_finished() for t in _trials(url, "stale"))


def test_a_repeat_of_a_measured_plan_is_not_run_again(ray_cluster, tmp_path, capsys):
    """One candidate, two side streams, fixed λ: the space holds three plans (no cut, the cut
    on the main stream, the cut on a side stream, whichever id), so with one slot at least
    two of five trials repeat a measured plan. The two seeds are one plan, with stream ids
    renumbered, and cost one run between them."""
    tickets = tmp_path / "tickets"
    tickets.mkdir()
    url = f"sqlite:///{tmp_path / 'dup.db'}"
    space = write_space(
        tmp_path / "dup.yaml", workload="tests.tune.faulty:workload", args={"mode": "ok", "tickets": str(tickets)},
        cuts={"candidates": ["subarchs.0"], "max_streams": 2, "aux_weight": 1.0},
        seeds=[{"name": "on-stream-1", "plan": {"num_streams": 1, "cuts": [{"module": "subarchs.0", "stream": 1}]}},
               {"name": "on-stream-2", "plan": {"num_streams": 2, "cuts": [{"module": "subarchs.0", "stream": 2}]}}],
    )
    assert run_cli("start", "--space", space, "--study", "dup", "--trials", 5, "--slots", 1, "--storage", url) == 0
    out = capsys.readouterr().out
    trials = _trials(url, "dup")
    assert len(trials) == 5 and all(t.state == TrialState.COMPLETE for t in trials)
    assert trials[0].user_attrs["seed_name"] == "on-stream-1"

    first_of: dict[str, optuna.trial.FrozenTrial] = {}
    repeats = []
    for t in trials:
        key = t.user_attrs["plan_key"]
        if key not in first_of:
            first_of[key] = t
            assert "duplicate_of" not in t.user_attrs
            continue
        repeats.append(t)
        earlier = first_of[key]
        assert t.user_attrs["duplicate_of"] == earlier.number
        assert t.values == earlier.values
        assert t.user_attrs["metrics"] == earlier.user_attrs["metrics"]
        assert f"trial {t.number}: same plan as trial {earlier.number}, not re-run" in out
    assert len(first_of) <= 3 and len(repeats) >= 2
    # Only distinct plans ran in a worker: one ticket each.
    assert len(list(tickets.iterdir())) == len(first_of)
    with Store(url) as store:
        rows = {r.trial_number: r for r in store.trial_measurements(store.get_job("dup"))}
        assert all(rows[t.number].status == "complete" for t in first_of.values())


def test_resuming_with_another_workload_is_refused(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'wl.db'}"
    first = write_space(tmp_path / "first.yaml", trials=1)
    assert run_cli("start", "--space", first, "--study", "wl", "--storage", url) == 0
    other = write_space(tmp_path / "other.yaml", args={"width": 24}, trials=2)
    capsys.readouterr()
    assert run_cli("start", "--space", other, "--study", "wl", "--storage", url) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "with other arguments" in err[0] and "use another study name" in err[0]
    assert len(_trials(url, "wl")) == 1  # nothing ran, nothing lost
