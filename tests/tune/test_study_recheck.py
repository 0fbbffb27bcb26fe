"""The study_recheck benchmark case (issue 27's Kendall tau over a whole study): every measured
trial of a real study is timed again in one process, beside its searched gain."""

from __future__ import annotations

import json

from erase_tune.benchmarks.runner import main
from tests.tune.conftest import run_cli
from tests.tune.faulty import write_space


def test_every_measured_trial_is_re_measured_and_ranked_against_its_search(ray_cluster, tmp_path, capsys):
    space = write_space(tmp_path / "s.yaml", trials=3)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert run_cli("start", "--space", space, "--study", "rc", "--storage", url, "--slots", 1, "--no-confirm") == 0
    capsys.readouterr()
    assert main(["study_recheck", "--out", str(tmp_path / "out"), "--storage", url, "--study", "rc",
                 "--windows", "2", "--max-windows", "3", "--halfwidth", "0.5"]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "out" / "study_recheck.json").read_text())["result"]
    rows = result["rows"]
    assert len(rows) == 3 and sorted(r["trial"] for r in rows) == [0, 1, 2]
    for r in rows:
        assert r["remeasured_lo"] <= r["remeasured"] <= r["remeasured_hi"] and 2 <= r["windows"] <= 3
    assert -1.0 <= result["kendall_tau"] <= 1.0 and "Kendall tau-b, searched vs re-measured, 3 trials" in out
    assert main(["study_recheck", "--out", str(tmp_path / "out"), "--storage", url, "--study", "nope"]) == 2
