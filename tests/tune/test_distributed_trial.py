"""Data-parallel trials: a space with ``gpus_per_trial: 2`` runs each trial on two ranks (two
Ray actors of one placement group, gloo on the CPU), end to end through a real local Ray and
a SQLite study; then ``export`` re-measures the front on a 2-rank worker group."""

from __future__ import annotations

import statistics

import optuna
import pytest
from optuna.trial import TrialState

from erase_tune.store import Store
from tests.tune.conftest import run_cli

SPACE = """
workload:
  name: ctr
  args: {batch: 64, width: 8, depth: 1, emb_dim: 4, num_tables: 4, rows: 100, sub_out: 4,
         train_batches: 64, eval_batches: 2}
cuts:
  candidates: [subarchs.0, subarchs.1, subarchs.2, subarchs.3, subarchs.4, subarchs.5]
  modes: [keep, detach]
  max_streams: 1
  dispatch: [threaded]
  find_unused_parameters: [false]
max_ne_gap: 1.0
budget: {warmup_steps: 5, windows: 2, max_windows: 2, window_steps: 3, quality_steps: 4, timeout_s: 120}
trials: 2
device: cpu
gpus_per_trial: 2
seeds:
  - name: no-cuts
    plan: {cuts: []}
  - name: two-cuts
    plan: {num_streams: 1, dispatch: threaded, cuts: [{module: subarchs.0, stream: 1}, {module: subarchs.3, stream: 1}]}
"""


def test_a_study_of_two_rank_trials(ray_cluster, tmp_path, capsys):
    space = tmp_path / "ddp.yaml"
    space.write_text(SPACE)
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert run_cli("start", "--space", space, "--study", "ddp", "--storage", url, "--no-confirm") == 0
    out = capsys.readouterr()
    assert "study ddp: 2 complete, 0 failed" in out.out, out.out + out.err
    study = optuna.load_study(study_name="ddp", storage=url)
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    assert [t.user_attrs.get("seed_name") for t in trials] == ["no-cuts", "two-cuts"]
    store = Store(url)
    job = store.get_job("ddp")
    for t in trials:
        o = store.outcome(job, t.number)
        assert o.status == "complete" and o.provenance["ranks"] == 2
        # QPS counts both ranks' examples: 2 x 64 per step over the step time
        steps = o.samples["candidate"]["steps_s"]
        assert t.user_attrs["candidate_median_qps"] == pytest.approx(statistics.median(128 / s for s in steps), rel=1e-9)
    store.close()

    # no confirmation yet: export re-measures the front, on a group of 2 ranks like the trials
    best = tmp_path / "best.yaml"
    assert run_cli("export", "--study", "ddp", "--storage", url, "--max-ne-gap", "1.0", "--repeats", 2, "-o", best,
                   "--force") == 0
    store = Store(url)
    confirmations = store.confirmations(store.get_job("ddp"))
    assert confirmations and all(c.provenance["ranks"] == 2 for c in confirmations)
    store.close()
