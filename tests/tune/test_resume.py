"""Resuming a job: ``--trials`` is the study's total, a repeat of a measured plan is answered
without running it, and a study of another workload is refused. (A driver killed or stopped
from outside, then resumed: test_resume_signals.py.)"""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from erase_tune.store import Store
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
    assert run_cli("start", "--space", space, "--study", "grow", "--trials", 3, "--storage", storage_url,
                   "--slots", 1, "--no-confirm") == 0
    assert [t.state for t in _trials(storage_url, "grow")] == [TrialState.COMPLETE] * 3
    assert run_cli("start", "--space", space, "--study", "grow", "--trials", 5, "--storage", storage_url,
                   "--slots", 1, "--no-confirm") == 0
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
                   "--slots", 1, "--no-confirm") == 0
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
    assert run_cli("start", "--space", first, "--study", "wl", "--storage", url, "--slots", 1, "--no-confirm") == 0
    other = write_space(tmp_path / "other.yaml", args={"width": 24}, trials=2)
    capsys.readouterr()
    assert run_cli("start", "--space", other, "--study", "wl", "--storage", url) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "with other arguments" in err[0] and "use another study name" in err[0]
    assert len(_trials(url, "wl")) == 1  # nothing ran, nothing lost
