"""The library commands end to end: ``erase-tune trial`` and ``bench`` on CPU, ``db upgrade``."""

from __future__ import annotations

import json

from erase_tune.cli import main
from erase_tune.runtime import Cut, ErasePlan
from erase_tune.store import Store, head_revision

TINY = ["--arg", "batch=64", "--arg", "width=16", "--arg", "depth=2", "--arg", "emb_dim=8", "--arg", "num_tables=8",
        "--arg", "rows=100", "--arg", "sub_out=8", "--arg", "train_batches=32", "--arg", "eval_batches=4"]
BUDGET = ["--warmup", "5", "--windows", "2", "--window-steps", "3", "--quality-steps", "10"]


def test_trial_table_and_json(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    ErasePlan(cuts=(Cut(module="subarchs.0", stream=1), Cut(module="subarchs.4")), num_streams=1,
              dispatch="threaded").save(plan)
    assert main(["trial", "--workload", "ctr", *TINY, "--plan", str(plan), "--device", "cpu", *BUDGET]) == 0
    out, err = capsys.readouterr()
    # before the first window (the long part: --window-steps 1000000 is hours) it says what it times
    timing = [line for line in err.splitlines() if line.startswith("timing ")]
    assert len(timing) == 1 and timing[0].endswith(": 2-20 windows of 3 steps each, until each gain's 95% interval "
                                                   "is within ±3%; Ctrl-C stops"), err
    assert all(name in timing[0] for name in ("baseline", "candidate", "detach_only")), timing
    # ... and so before the warm-up and the training on for NE (--warmup or --quality-steps 1000000 are hours)
    warming = [line for line in err.splitlines() if line.startswith("warming up ")]
    assert len(warming) == 1 and warming[0].endswith(": 5 steps each before timing; Ctrl-C stops"), err
    training = [line for line in err.splitlines() if line.startswith("training ")]
    assert len(training) == 1 and " for held-out NE; Ctrl-C stops" in training[0], err
    assert err.index(warming[0]) < err.index(timing[0]) < err.index(training[0])
    for needle in ("baseline", "candidate", "detach_only", "gain p90", "NE gap", "of which work removed"):
        assert needle in out, out
    assert main(["trial", "--workload", "ctr", *TINY, "--plan", str(plan), "--device", "cpu", *BUDGET, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["variants"]) == {"baseline", "candidate", "detach_only"}  # no graph reference on CPU
    # --windows 2 is the least a trial times: it runs on until its interval is narrow (or 20 windows).
    assert 2 <= result["windows"] <= 20 and len(result["variants"]["candidate"]["steps_s"]) == 3 * result["windows"]
    assert result["gain_lo"] <= result["gain"] <= result["gain_hi"] and result["exact"] is False
    assert result["provenance"]["workload_args"]["batch"] == 64 and result["provenance"]["torch"]
    assert 0 < result["ne_baseline"] < 2 and result["gain_vs_reference"] is None


def test_bench_table(capsys):
    assert main(["bench", "--workload", "ctr", *TINY, "--device", "cpu", "--warmup", "5", "--windows", "2",
                 "--window-steps", "2", "--streams", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("plain loop", "eager baseline", "ERASE blocking", "ERASE threaded"):
        assert name in out
    assert "graph baseline" not in out  # CUDA-only variants are not offered on the CPU


def test_db_upgrade_and_current(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert main(["db", "upgrade", "--storage", url]) == 0
    assert head_revision() in capsys.readouterr().out
    with Store(url) as store:
        assert store.schema_version().revision == head_revision()
    assert main(["db", "current", "--storage", url]) == 0


def test_a_trial_loads_no_optuna_sql_or_ray(tmp_path):
    """``trial`` measures one plan with the library alone: its table is printed without the
    service's stack (Optuna, SQLAlchemy, Alembic, Ray), which took 1.2 s to import."""
    import subprocess
    import sys
    from pathlib import Path

    plan = tmp_path / "plan.yaml"
    ErasePlan(cuts=(Cut(module="subarchs.0"),)).save(plan)
    argv = ["trial", "--workload", "ctr", "--arg", "batch=16", "--arg", "num_tables=2", "--arg", "rows=10",
            "--arg", "train_batches=1", "--plan", str(plan), "--device", "cpu", "--warmup", "5", "--windows", "1",
            "--window-steps", "1", "--quality-steps", "2"]
    code = ("import json, sys; from erase_tune.cli import main; code = main(%r); "
            "print(json.dumps([code, sorted(m for m in ('optuna', 'sqlalchemy', 'alembic', 'ray') if m in sys.modules)]))"
            % argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    exit_code, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert exit_code == 0 and loaded == [], (exit_code, loaded, done.stderr[-2000:])
