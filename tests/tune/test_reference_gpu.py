"""On GPU slots, a model whose step cannot be captured whole: the whole-step-graph reference is
tried once per job, on a worker, before the first trial; trials then run without it and none
fails for it; the outcome is kept on the study (a resumed job does not try again); a
``whole_step_graph: true`` choice is dropped with one line, and ``gain_over: graph`` is refused
with one line naming the capture error before any trial runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from erase_tune.tune.search.study import Attr
from tests.tune.conftest import run_cli

pytestmark = pytest.mark.gpu


def _space(path: Path, **fields: Any) -> Path:
    space = {
        "workload": {"name": "tests.host_index:workload", "args": {"batch": 256}},
        "cuts": {"candidates": ["left", "right"], "max_streams": 1, "modes": ["keep", "detach"],
                 "dispatch": ["blocking"], "graph": [False], "whole_step_graph": [False, True],
                 "aux_weight": {"low": 0.3, "high": 3.0, "log": True}},
        "max_ne_gap": 0.05,
        "sampler": {"name": "random", "seed": 0},
        "budget": {"warmup_steps": 5, "windows": 2, "window_steps": 3, "quality_steps": 5, "timeout_s": 120},
        "trials": 3,
        "device": "cuda",
        **fields,
    }
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def test_a_job_on_a_model_that_cannot_be_captured_whole(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'hostidx.db'}"
    space = _space(tmp_path / "hostidx.yaml")
    assert run_cli("start", "--space", space, "--study", "hostidx", "--storage", url, "--slots", 1,
                   "--no-confirm") == 0
    captured = capsys.readouterr()
    shown = [line for line in captured.err.splitlines() if "cannot be captured whole" in line]
    assert len(shown) == 1 and "whole_step_graph: true choice is dropped" in shown[0], captured.err
    assert "study hostidx: 3 complete, 0 failed" in captured.out
    study = optuna.load_study(study_name="hostidx", storage=url)
    error = study.user_attrs[Attr.REFERENCE_ERROR]
    assert "whole-step CUDA graph capture failed" in error and error in shown[0]
    trials = study.get_trials()
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert not any(t.user_attrs[Attr.PLAN].get("whole_step_graph") for t in trials)
    assert all("gain_vs_graph" not in t.user_attrs for t in trials)  # no reference was timed

    # Resumed: the stored outcome is used, not tried again (a marker stands in for it).
    storage = optuna.storages.RDBStorage(url)
    optuna.load_study(study_name="hostidx", storage=storage).set_user_attr(Attr.REFERENCE_ERROR, "stored reason")
    assert run_cli("start", "--space", space, "--study", "hostidx", "--storage", url, "--trials", 4, "--slots", 1,
                   "--no-confirm") == 0
    err = capsys.readouterr().err
    assert "cannot be captured whole (stored reason)" in err


def test_gain_over_graph_is_refused_before_any_trial(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'graph.db'}"
    space = _space(tmp_path / "graph.yaml", gain_over="graph")
    assert run_cli("start", "--space", space, "--study", "graph", "--storage", url) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("erase-tune: error: ") and "gain_over: graph" in err[-1]
    assert "whole-step CUDA graph capture failed" in err[-1]
    assert optuna.load_study(study_name="graph", storage=url).get_trials() == []
