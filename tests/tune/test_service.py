"""The service end to end: start → trials in the SQL study (SQLite and PostgreSQL, real Ray)
→ confirmation of the front → status → export → the exported plan trains in
examples/train_ctr.py."""

from __future__ import annotations

import json
import os
import subprocess

import optuna
from optuna.trial import TrialState

from erase_tune.runtime import ErasePlan
from erase_tune.store import Store
from tests.tune.conftest import ROOT, SMOKE, run_cli


def test_start_status_export_train(storage_url, ray_cluster, tmp_path, capsys, python):
    # The shipped smoke space, its stop rules capped at 6 windows for a trial and 8 for the front's
    # re-measurement: a loaded machine's noise would time them on to the 20 and 40 they allow.
    space = tmp_path / "ctr-smoke.yaml"
    space.write_text(SMOKE.read_text().replace("budget: {", "budget: {max_windows: 6, confirm_max_windows: 8, ", 1))
    assert run_cli("start", "--space", space, "--study", "svc", "--trials", 6, "--storage", storage_url,
                   "--repeats", 3) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "study svc: 6 complete, 0 failed" in out and "overhead per trial" in out and "once per job: worker start" in out
    assert f"erase-tune status --study svc --storage {storage_url}" in out  # the exact next commands
    assert "re-measured" in out  # the front was confirmed at the end
    assert "measured, 0 running" in captured.err and "elapsed" in captured.err  # progress, on stderr
    # The first line says whose code runs (a space file is trusted like a script).
    assert captured.err.splitlines()[0].startswith("workload ctr: code from module erase_tune.workloads.ctr runs")

    study = optuna.load_study(study_name="svc", storage=storage_url)
    assert study.metric_names == ["qps_gain", "ne_gap"]
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    measured = [t for t in trials if "duplicate_of" not in t.user_attrs]
    assert len(measured) == 6
    assert [t.user_attrs.get("seed_name") for t in trials[:3]] == ["no-cuts", "all-placed", "all-six"]
    first = trials[0]
    assert first.user_attrs["plan"]["cuts"] == [] and first.user_attrs["ray_node"]
    t = trials[2]
    # Flat, sortable metrics; the objective is one of them; the budget is the dashboard's constraint.
    assert t.user_attrs["candidate_p90_qps"] > 0 and 0 < t.user_attrs["ne_baseline"] < 2
    assert abs(t.values[0] - t.user_attrs["gain_vs_eager"]) < 1e-12
    # The budget is judged beyond the noise floor measured before the trials (ctr-smoke: 2 orders).
    band = study.user_attrs["ne_noise_band"]
    assert study.user_attrs["noise_floor"]["kinds"] == ["order", "order"] and band >= 0
    assert t.system_attrs["constraints"] == [t.values[1] - (0.05 + band)]
    assert t.user_attrs["feasible"] == (t.values[1] <= 0.05 + band)
    assert first.user_attrs["exact"] is True and first.values[1] == 0.0  # no cuts: its gap is noise

    store = Store(storage_url)
    job = store.get_job("svc")
    assert job.status == "finished" and job.n_trials_target == 6
    o = store.outcome(job, t.number)
    assert o.status == "complete" and o.node and o.provenance["torch"]
    # ctr-smoke times 4 windows of 5 steps at least, then on until the gain's interval is narrow (at most 6 here).
    windows = sorted(set(o.samples["candidate"]["window"]))
    assert 4 <= len(windows) <= 6 and windows == list(range(len(windows)))
    assert len(o.samples["candidate"]["steps_s"]) == 5 * len(windows)
    confirmations = store.confirmations(job)  # the end of start re-measured the front
    assert confirmations and all(3 <= c.windows <= 8 for c in confirmations)
    assert store.noise_floor(job).band == band
    store.close()

    assert run_cli("status", "--study", "svc", "--storage", storage_url) == 0
    out = capsys.readouterr().out
    assert "6 measured" in out and "Pareto front" in out and "confirmed" in out
    assert "noise floor of the NE gap: ±" in out
    assert run_cli("status", "--study", "svc", "--storage", storage_url, "--trial", t.number) == 0
    out = capsys.readouterr().out
    assert f"trial {t.number}: COMPLETE" in out and f"samples candidate: {5 * len(windows)} steps" in out
    assert "torch" in out

    best = tmp_path / "best.yaml"
    code = run_cli("export", "--study", "svc", "--storage", storage_url, "--max-ne-gap", "1.0", "--repeats", 3,
                   "-o", best, "--force", "--json")
    assert code == 0
    written = json.loads(capsys.readouterr().out)
    plan = ErasePlan.load(best)
    prov = plan.provenance
    assert prov["study"] == "svc" and prov["workload"] == "ctr" and prov["trial"] == written["trial"]
    assert prov["search_qps_gain"] == written["search_qps_gain"]
    assert "confirmed_gain" in prov and prov["confirmed_gain_lo"] <= prov["confirmed_gain"] <= prov["confirmed_gain_hi"]
    assert prov["ne_noise_band"] == band and "quality_confirmed" in prov and "search_ne_gap" in prov
    with Store(storage_url) as store:
        assert len(store.exports(store.get_job("svc"))) == 1

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([python, str(ROOT / "examples" / "train_ctr.py"), "--plan", str(best), "--steps", "150"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "held-out NE" in done.stdout


def test_the_no_cuts_plan_is_never_exported_as_a_gain(ray_cluster, tmp_path, capsys):
    """A space that can only propose the baseline: its search 'gain' is noise, the
    confirmation says it is the baseline, and export refuses (exit 1) unless forced."""
    from tests.tune.faulty import write_space

    url = f"sqlite:///{tmp_path / 'base.db'}"
    space = write_space(tmp_path / "base.yaml", cuts={"modes": ["keep"]}, trials=1)
    assert run_cli("start", "--space", space, "--study", "base", "--storage", url, "--repeats", 2,
                   "--slots", 1) == 0
    capsys.readouterr()
    out = tmp_path / "best.yaml"
    assert run_cli("export", "--study", "base", "--storage", url, "--repeats", 2, "-o", out) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "it is the baseline itself" in err[0] and not out.exists()
    assert run_cli("export", "--study", "base", "--storage", url, "--repeats", 2, "-o", out, "--force") == 0
    plan = ErasePlan.load(out)
    assert plan.cuts == () and plan.provenance["confirmed"] is False
