"""Hostile and mistaken input at the command line: exit code 2 and one line on stderr,
``erase-tune: error: ...`` naming the problem, never a traceback, never a password, and
nothing already stored is lost (a finished job stays finished, with all its trials)."""

from __future__ import annotations

import os
from pathlib import Path

import optuna
import pytest
import yaml

from erase_tune.store import Store
from tests.tune.conftest import ROOT, SMOKE, cli, run_cli
from tests.tune.faulty import write_space

SECRET = "s3cret"
DEAD_PG = f"postgresql+psycopg://user:{SECRET}@127.0.0.1:1/x"


def one_error_line(err: str, *needles: str) -> str:
    """The single stderr line; checks its form and that it names each of ``needles``."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("erase-tune: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def finished_job(ray_cluster, tmp_path_factory) -> dict:
    """A small finished job on SQLite, and a snapshot of everything stored for it."""
    tmp = tmp_path_factory.mktemp("done")
    url = f"sqlite:///{tmp / 'done.db'}"
    space = write_space(tmp / "done.yaml", trials=2)
    assert run_cli("start", "--space", space, "--study", "done", "--storage", url, "--slots", 1, "--no-confirm") == 0
    return {"url": url, "space": space, "tmp": tmp, "snapshot": _snapshot(url)}


def _snapshot(url: str) -> dict:
    trials = optuna.load_study(study_name="done", storage=url).get_trials()
    with Store(url) as store:
        job = store.get_job("done")
        rows = [store.outcome(job, t.number) for t in trials]
    return {
        "trials": [(t.number, t.state, t.values, t.params, t.user_attrs) for t in trials],
        "job": (job.id, job.status, job.space_yaml, job.n_trials_target),
        "rows": [(r.trial_number, r.status, r.samples) for r in rows],
    }


@pytest.fixture
def intact(finished_job):
    """After the test: the finished job and its trials are all still there, unchanged."""
    yield finished_job
    assert _snapshot(finished_job["url"]) == finished_job["snapshot"]


@pytest.fixture
def plan_file(tmp_path) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text("cuts: [subarchs.0]\n")
    return path


TINY_ARGS = [a for k, v in {"batch": 16, "num_tables": 2, "rows": 10, "train_batches": 1}.items()
             for a in ("--arg", f"{k}={v}")]


# -- erase-tune trial ----------------------------------------------------------------------


def test_trial_missing_plan_file(tmp_path, capsys):
    assert run_cli("trial", "--workload", "ctr", "--plan", tmp_path / "nope.yaml") == 2
    one_error_line(capsys.readouterr().err, "nope.yaml", "not found")


def test_trial_malformed_plan_yaml_in_a_terminal(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cuts: [subarchs.0\n")
    done = cli("trial", "--workload", "ctr", "--plan", bad)
    assert done.returncode == 2
    one_error_line(done.stderr, "bad.yaml", "YAML")
    assert done.stdout == ""


def test_trial_plan_naming_a_missing_module(tmp_path, capsys):
    plan = tmp_path / "miss.yaml"
    plan.write_text("cuts: [towers.7]\n")
    assert run_cli("trial", "--workload", "ctr", *TINY_ARGS, "--plan", plan) == 2
    one_error_line(capsys.readouterr().err, "miss.yaml", "cuts[0].module", "towers.7")


def test_trial_unknown_workload(plan_file, capsys):
    assert run_cli("trial", "--workload", "nosuch", "--plan", plan_file) == 2
    one_error_line(capsys.readouterr().err, "unknown workload 'nosuch'")
    assert run_cli("trial", "--workload", "nosuch_pkg.mod:make", "--plan", plan_file) == 2
    one_error_line(capsys.readouterr().err, "cannot import module 'nosuch_pkg.mod'")


@pytest.mark.parametrize("arg, needle", [
    ("batch=abc", "argument 'batch' must be int"),
    ("nokey", "--arg: 'nokey' is not KEY=VALUE"),
    ("=5", "is not KEY=VALUE"),
    ("bogus=1", "unknown argument 'bogus'"),
])
def test_trial_bad_arg(plan_file, capsys, arg, needle):
    assert run_cli("trial", "--workload", "ctr", "--arg", arg, "--plan", plan_file) == 2
    one_error_line(capsys.readouterr().err, needle)


# -- erase-tune start ----------------------------------------------------------------------


def test_start_missing_space_file_in_a_terminal(intact, tmp_path):
    done = cli("start", "--space", tmp_path / "nope.yaml", "--study", "done", "--storage", intact["url"])
    assert done.returncode == 2
    one_error_line(done.stderr, "nope.yaml", "not found")


@pytest.mark.parametrize("change, needles", [
    ({"budget": {"timeout_s": -1}}, ["budget.timeout_s"]),
    ({"trials": "many"}, ["trials", "'many'"]),
    ({"trials": 10**30}, ["trials", "a huge integer"]),
    ({"sampler": {"name": "tpe", "seed": 2**40}}, ["sampler.seed", "0..4294967295"]),
    ({"objectives": 5}, ["objectives: must be"]),
    ({"seeds": 5}, ["seeds: must be a list"]),
    ({"cuts": {"max_streams": -2}}, ["cuts.max_streams"]),
    ({"colour": "blue"}, ["'colour': unknown field"]),
    ({"sampler": "cmaes"}, ["sampler.name", "'cmaes'"]),
    ({"cuts": {"candidates": ["subarchs.0", "towers.9"]}}, ["cuts.candidates", "towers.9"]),
    ({"workload": {"name": "ctr", "args": {"batch": "big"}}}, ["argument 'batch'"]),
    ({"workload": {"name": "ctr", "args": {"rows": 10**12}}}, ["rows=1000000000000", "more than this machine"]),
    ({"seeds": [{"name": "s", "plan": {"cuts": ["subarchs.5"]}}]}, ["seeds[0]", "subarchs.5"]),
])
def test_start_bad_space(intact, tmp_path, capsys, change, needles):
    space = yaml.safe_load(Path(intact["space"]).read_text())
    for key, value in change.items():
        merge = isinstance(value, dict) and isinstance(space.get(key), dict) and key != "workload"
        space[key] = {**space[key], **value} if merge else value
    path = tmp_path / "bad-space.yaml"
    path.write_text(yaml.safe_dump(space))
    assert run_cli("start", "--space", path, "--study", "done", "--storage", intact["url"]) == 2
    one_error_line(capsys.readouterr().err, str(path), *needles)


def test_start_malformed_space_yaml(intact, tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("workload: {name: ctr\n")
    assert run_cli("start", "--space", path, "--study", "done", "--storage", intact["url"]) == 2
    one_error_line(capsys.readouterr().err, "broken.yaml", "not valid YAML")


@pytest.mark.parametrize("flags, needle", [
    (["--trials", "0"], "--trials"),
    (["--trials", "100001"], "--trials"),
    (["--slots", "0"], "--slots"),
    (["--slots", "1000000"], "--slots"),
    (["--gpu-wait", "nan"], "--gpu-wait"),
    (["--gpu-wait", "1e308"], "--gpu-wait"),
    (["--grace-period", "9"], "--grace-period"),
    (["--grace-period", "99999999"], "--grace-period"),
    (["--ray-address", "127.0.0.1:" + "9" * 5000], "--ray-address"),
    (["--ray-address", "ray://127.0.0.1:1"], "nothing answers at ray://127.0.0.1:1"),
])
def test_start_bad_numbers_leave_the_job_alone(intact, capsys, flags, needle):
    assert run_cli("start", "--space", intact["space"], "--study", "done", "--storage", intact["url"], *flags) == 2
    one_error_line(capsys.readouterr().err, needle)


def test_start_unreachable_storage_never_shows_the_password(intact):
    done = cli("start", "--space", intact["space"], "--storage", DEAD_PG)
    assert done.returncode == 2
    line = one_error_line(done.stderr, "127.0.0.1:1", "user:***@")
    assert SECRET not in done.stdout + done.stderr, line


@pytest.mark.parametrize("url, needle", [
    (DEAD_PG, "127.0.0.1:1"),
    (f"postgresql+psycopg://user:{SECRET}@127.0.0.1:5432/x?password={SECRET}", "password=***"),
    (f"mysql://user:{SECRET}@127.0.0.1:1/x", "mysql"),
    ("not a url", "storage URL"),
])
def test_bad_storage_urls(intact, tmp_path, capsys, url, needle):
    for argv in (["start", "--space", intact["space"]], ["status"], ["export", "--study", "x", "-o", tmp_path / "p.yaml"]):
        assert run_cli(*argv, "--storage", url) == 2
        captured = capsys.readouterr()
        one_error_line(captured.err, needle)
        assert SECRET not in captured.out + captured.err
    assert not (tmp_path / "p.yaml").exists()


# -- erase-tune status / export --------------------------------------------------------------


def test_status_and_export_unknown_study(intact, tmp_path, capsys):
    assert run_cli("status", "--study", "nope", "--storage", intact["url"]) == 2
    one_error_line(capsys.readouterr().err, "no study named 'nope'", "studies: done")
    assert run_cli("export", "--study", "nope", "--storage", intact["url"], "-o", tmp_path / "p.yaml") == 2
    one_error_line(capsys.readouterr().err, "no study named 'nope'")
    assert not (tmp_path / "p.yaml").exists()


def test_status_and_export_of_a_database_that_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "typo.db"
    for argv in (["status"], ["export", "--study", "done", "-o", tmp_path / "p.yaml"]):
        assert run_cli(*argv, "--storage", f"sqlite:///{missing}") == 2
        one_error_line(capsys.readouterr().err, str(missing))
    assert not missing.exists()  # a typo in a path must not create an empty database


def test_export_with_a_budget_out_of_range_keeps_everything(intact, capsys):
    out = intact["tmp"] / "best.yaml"  # a negative budget (once: "no trial is within") is refused as such (issue 30)
    assert run_cli("export", "--study", "done", "--storage", intact["url"], "--max-ne-gap", "-1", "-o", out) == 2
    one_error_line(capsys.readouterr().err, "--max-ne-gap: -1.0 must be between 0 and 100")
    assert not out.exists()
    assert not list(intact["tmp"].glob(".best.yaml.*"))  # no temporary file left behind either
    with Store(intact["url"]) as store:
        assert store.exports(store.get_job("done")) == []


def test_export_into_a_missing_directory(intact, tmp_path, capsys):
    out = tmp_path / "no" / "such" / "dir" / "best.yaml"
    assert run_cli("export", "--study", "done", "--storage", intact["url"], "--max-ne-gap", "1", "-o", out) == 2
    one_error_line(capsys.readouterr().err, str(out.parent), "does not exist")
    assert not out.parent.exists()


def test_export_onto_a_directory_or_into_a_read_only_one(intact, tmp_path, capsys):
    assert run_cli("export", "--study", "done", "--storage", intact["url"], "-o", tmp_path) == 2
    one_error_line(capsys.readouterr().err, str(tmp_path), "is a directory")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code = run_cli("export", "--study", "done", "--storage", intact["url"], "-o", locked / "best.yaml")
        if os.geteuid() != 0:  # root writes anywhere: the permission cannot be tested as root
            assert code == 2
            one_error_line(capsys.readouterr().err, str(locked), "not writable")
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("flag", ["--storage", "--study"])
def test_empty_storage_or_study_is_an_error(intact, capsys, flag):
    argv = {"--storage": ["--study", "x", "--storage", ""], "--study": ["--study", "", "--storage", intact["url"]]}
    assert run_cli("start", "--space", intact["space"], *argv[flag]) == 2
    one_error_line(capsys.readouterr().err, "empty" if flag == "--storage" else "--study")


# -- argparse --------------------------------------------------------------------------------


def test_usage_errors_in_a_terminal():
    for argv, needle in ((["status", "--bogus"], "unrecognized arguments: --bogus"),
                         (["frobnicate"], "invalid choice: 'frobnicate'")):
        done = cli(*argv)
        assert done.returncode == 2
        one_error_line(done.stderr, needle)
        assert done.stdout == ""


@pytest.mark.parametrize("argv, needle", [
    ([], "required: COMMAND"),
    (["export", "--study", "x"], "required: -o/--output"),
    (["export", "--study", "x", "-o", "p.yaml", "--pick", "best"], "--pick"),
    (["start", "--space", "s.yaml", "--trials", "ten"], "--trials: invalid int value: 'ten'"),
    (["trial", "--plan", "p.yaml"], "required: --workload"),
])
def test_usage_errors_in_process(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        run_cli(*argv)
    assert exc.value.code == 2
    one_error_line(capsys.readouterr().err, needle)


def test_unreachable_ray_address_fails_fast(tmp_path, capsys):
    import socket
    import time

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    code = run_cli("start", "--space", SMOKE, "--study", "nowhere", "--trials", 1,
                   "--storage", f"sqlite:///{tmp_path / 'r.db'}", "--ray-address", f"127.0.0.1:{port}")
    assert code == 2 and time.monotonic() - started < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"nothing answers at 127.0.0.1:{port}" in err[0]
    assert not (tmp_path / "r.db").exists()  # a bad Ray address writes nothing


def test_a_gpu_space_on_a_cluster_without_gpus_is_refused_before_anything_runs(ray_cluster, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'g.db'}"
    space = yaml.safe_load((ROOT / "search_spaces" / "ctr.yaml").read_text())
    space["device"] = "auto"  # the shipped file says cuda (and a local Ray without a GPU refuses that at once)
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(space))
    import ray

    groups = len(ray.util.placement_group_table())  # removed ones stay listed
    assert run_cli("start", "--space", path, "--study", "g", "--trials", 1, "--storage", url) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gain_over: graph needs GPU trial slots" in err[0]
    assert not (tmp_path / "g.db").exists()  # refused before the storage was touched
    assert len(ray.util.placement_group_table()) == groups  # and before any trial worker started
