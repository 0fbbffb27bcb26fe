"""The service end to end: start → trials in the SQL study (SQLite and PostgreSQL, real Ray)
→ status → export → the exported plan trains in examples/train_ctr.py."""

from __future__ import annotations

import os
import subprocess

import optuna
from optuna.trial import TrialState

from erase_tune.runtime import ErasePlan
from erase_tune.store import Store
from tests.tune.conftest import ROOT, SMOKE, run_cli


def test_start_status_export_train(storage_url, ray_cluster, tmp_path, capsys, python):
    assert run_cli("start", "--space", SMOKE, "--study", "svc", "--trials", 8, "--storage", storage_url) == 0
    out = capsys.readouterr().out
    assert "study svc: 8 complete, 0 failed" in out and "scheduler overhead per trial" in out

    study = optuna.load_study(study_name="svc", storage=storage_url)
    assert study.metric_names == ["qps_gain", "ne_gap"]
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(trials) == 8
    seeds = [t.user_attrs.get("seed_name") for t in trials[:2]]
    assert seeds == ["no-cuts", "all-six"]  # enqueued before the sampler proposes
    first = trials[0]
    assert first.user_attrs["plan"]["cuts"] == [] and first.user_attrs["ray_node"]
    m = trials[1].user_attrs["metrics"]
    assert m["candidate_p90_qps"] > 0 and m["baseline_p90_qps"] > 0 and 0 < m["ne_baseline"] < 2
    assert abs(trials[1].values[0] - m["gain_p90"]) < 1e-12

    store = Store(storage_url)
    job = store.get_job("svc")
    assert job.status == "finished" and job.n_trials_target == 8
    rows = store.trial_measurements(job)
    assert [r.trial_number for r in rows] == list(range(8))
    assert all(r.status == "complete" and len(r.samples["candidate"]) == 20 for r in rows)  # 4 windows x 5 steps
    assert all(r.ray_node for r in rows)

    assert run_cli("status", "--study", "svc", "--storage", storage_url) == 0
    out = capsys.readouterr().out
    assert "8 complete" in out and "Pareto front" in out

    best = tmp_path / "best.yaml"
    assert run_cli("export", "--study", "svc", "--storage", storage_url, "--max-ne-gap", "1.0", "-o", best) == 0
    plan = ErasePlan.load(best)
    assert plan.provenance["study"] == "svc" and plan.provenance["workload"]["name"] == "ctr"
    assert plan.provenance["qps_gain"] == max(t.values[0] for t in trials if t.values[1] <= 1.0)
    assert len(store.exports(job)) == 1
    store.close()

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([python, str(ROOT / "examples" / "train_ctr.py"), "--plan", str(best), "--steps", "150"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "held-out NE" in done.stdout
