"""A two-task study (issue 29 item 6): each trial of a study of ``tests.multitask:workload``
records each task's NE gap (``ne_gap.<task>``), and the gap the study judges is the main task's."""

from __future__ import annotations

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from tests.tune.conftest import run_cli
from tests.tune.faulty import write_space


@pytest.mark.parametrize("main_task", ["conversion"])
def test_a_two_task_study_reports_each_tasks_ne_gap(ray_cluster, tmp_path, capsys, main_task):
    space = write_space(tmp_path / "tasks.yaml", workload="tests.multitask:workload",
                        cuts={"candidates": ["bottom", "click.0", "conversion.0"]}, trials=3)
    doc = yaml.safe_load(space.read_text())
    doc["workload"]["args"] = {"batch": 32, "steps": 32, "main_task": main_task}  # not the CTR arguments
    space.write_text(yaml.safe_dump(doc, sort_keys=False))
    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert run_cli("start", "--space", space, "--study", "mt", "--storage", url, "--slots", 1, "--no-confirm") == 0, \
        capsys.readouterr().err[-3000:]
    trials = optuna.load_study(study_name="mt", storage=url).get_trials(states=(TrialState.COMPLETE,))
    measured = [t for t in trials if "duplicate_of" not in t.user_attrs]
    assert len(measured) == 3
    for t in measured:
        attrs = t.user_attrs
        assert {"ne_gap.click", "ne_gap.conversion"} <= set(attrs), sorted(attrs)
        assert attrs["ne_gap"] == attrs[f"ne_gap.{main_task}"]
        if attrs["exact"]:
            assert attrs["ne_gap.click"] == attrs["ne_gap.conversion"] == 0.0
    cut = [t for t in measured if not t.user_attrs["exact"]]
    assert cut and all(t.values[1] == t.user_attrs[f"ne_gap.{main_task}"] for t in cut)
    # status shows each task's gap under each front row
    capsys.readouterr()
    assert run_cli("status", "--study", "mt", "--storage", url) == 0
    shown = capsys.readouterr().out
    assert "NE gap by task: click " in shown and ", conversion " in shown, shown
