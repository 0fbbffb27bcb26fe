"""A storage whose stored values were damaged (edited by hand, written by another program, a
disk error): the commands that read it say so in one line, never a traceback, and change
nothing (issue 30)."""

from __future__ import annotations

import gc
import hashlib
import sqlite3

import pytest

from tests.tune.conftest import run_cli
from tests.tune.studies import STUDY_NAME, write_finished_study
from tests.tune.test_cli_errors import one_error_line

READERS = (["status"], ["status", "--json"], ["status", "--study", STUDY_NAME],
           ["status", "--study", STUDY_NAME, "--trial", "12", "--json"])


@pytest.fixture
def stored(tmp_path):
    url = write_finished_study(tmp_path / "s.db", gain_over="eager")
    assert run_cli("db", "upgrade", "--storage", url) == 0
    return url, tmp_path / "s.db"


def _sql(path, statement: str, *args) -> None:
    conn = sqlite3.connect(path)
    conn.execute(statement, args)
    conn.commit()
    conn.close()


def _bytes(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _readers_say(url, path, capsys, *needles, argvs=READERS) -> None:
    before = _bytes(path)
    for argv in argvs:
        assert run_cli(*argv, "--storage", url) == 2, argv
        one_error_line(capsys.readouterr().err, *needles, "nothing was changed")
    assert _bytes(path) == before


@pytest.mark.parametrize("value", ["not json", "{", "", "[" * 5000 + "]" * 5000])
@pytest.mark.parametrize(("table", "key"), [("study_user_attributes", "max_ne_gap"),
                                            ("trial_user_attributes", "plan"),
                                            ("trial_system_attributes", "constraints")])
def test_a_stored_attribute_that_is_not_json_is_one_line(stored, capsys, table, key, value):
    url, path = stored
    _sql(path, f"UPDATE {table} SET value_json = ? WHERE key = ?", value, key)
    # was: a JSONDecodeError (or RecursionError) traceback from Optuna's reading of the study
    _readers_say(url, path, capsys, "holds damaged data: while", "a stored value is")


def test_no_collection_runs_at_the_depth_a_too_deep_value_is_read_to(stored, capsys):
    """Decoding a value nested 5000 deep reaches the recursion limit. A garbage collection
    there ran the collector's callbacks (and other objects' finalizers) at that depth, where
    each failed and printed its traceback beside the one line: seen in the full suite, made
    certain here by collecting at every allocation with a callback that calls a little deeper."""
    url, path = stored
    _sql(path, "UPDATE study_user_attributes SET value_json = ? WHERE key = 'max_ne_gap'", "[" * 5000 + "]" * 5000)

    def deeper(n: int) -> int:
        return n if n <= 0 else deeper(n - 1)

    def callback(phase: str, info: dict) -> None:
        deeper(3)

    threshold = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1)
    try:
        _readers_say(url, path, capsys, "holds damaged data: while", "nested too deeply", argvs=READERS[:2])
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(callback)
    assert gc.isenabled()


def test_a_job_column_that_is_not_json_is_one_line(stored, capsys, tmp_path):
    url, path = stored
    from erase_tune.store.storage import open_storage

    db = open_storage(url)
    try:
        db.store.create_job(study_name=STUDY_NAME, space_path="x.yaml", space_yaml="", workload="ctr")
    finally:
        db.close()
    _sql(path, "UPDATE et_jobs SET settings = 'not json'")
    _readers_say(url, path, capsys, "holds damaged data: while", "not JSON",
                 argvs=(["status"], ["export", "--study", STUDY_NAME, "-o", tmp_path / "best.yaml"]))


@pytest.mark.parametrize(("where", "key", "value", "needle"), [
    ("study", "max_ne_gap", '"abc"', "its stored attribute 'max_ne_gap' is 'abc', not a number"),
    ("study", "workload", "[1, 2]", "its stored attribute 'workload' is [1, 2], not a mapping with a name"),
    ("study", "gain_over", "7", "its stored attribute 'gain_over' is 7, not eager or graph"),
    ("study", "noise_floor", "5", "its stored attribute 'noise_floor' is 5, not a noise floor"),
    ("trial", "gain_vs_graph", "[]", "trial 12's stored attribute 'gain_vs_graph' is [], not a number"),
    ("trial", "plan", "5", "trial 12's stored attribute 'plan' is 5, not a mapping"),
    ("trial", "feasible", '"yes"', "trial 12's stored attribute 'feasible' is 'yes', not true or false"),
])
def test_a_stored_attribute_of_the_wrong_kind_is_one_line(stored, capsys, tmp_path, where, key, value, needle):
    url, path = stored
    if where == "study":
        _sql(path, "INSERT OR REPLACE INTO study_user_attributes (study_id, key, value_json) VALUES (1, ?, ?)",
             key, value)
    else:
        _sql(path, "DELETE FROM trial_user_attributes WHERE key = ? AND trial_id = "
                   "(SELECT trial_id FROM trials WHERE number = 12)", key)
        _sql(path, "INSERT INTO trial_user_attributes (trial_id, key, value_json) "
                   "SELECT trial_id, ?, ? FROM trials WHERE number = 12", key, value)
    # was: a TypeError or AttributeError traceback from formatting the table or choosing the plan
    _readers_say(url, path, capsys, f"study '{STUDY_NAME}': {needle}", "(damaged?)",
                 argvs=(*READERS[2:], ["export", "--study", STUDY_NAME, "-o", tmp_path / "best.yaml"],
                        ["report", "--study", STUDY_NAME, "-o", tmp_path / "rep"]))


def test_an_export_it_could_not_record_says_the_plan_was_written(tmp_path, capsys, monkeypatch):
    from erase_tune.runtime import ErasePlan
    from tests.hostile_world_30 import World

    world = World(tmp_path)
    try:
        path = world.copy()
        _sql(path, "DROP TABLE et_exports")
        monkeypatch.setenv("ERASE_TUNE_STORAGE_RETRY_S", "0.5")
        out = tmp_path / "best.yaml"
        assert run_cli("export", "--study", STUDY_NAME, "--storage", f"sqlite:///{path}", "-o", out) == 3
        err = capsys.readouterr().err
        # was: "lost while recording an export", read as if nothing were written, and the plan was there
        assert err.strip().splitlines()[-1].startswith(f"erase-tune: error: wrote {out}, but did not record the export")
        assert ErasePlan.load(out).provenance["study"] == STUDY_NAME
    finally:
        world.close()


@pytest.mark.parametrize("value", ["5", "[]", '"x"'])
def test_a_job_column_of_the_wrong_kind_is_one_line(stored, capsys, tmp_path, value):
    url, path = stored
    from erase_tune.store.storage import open_storage

    db = open_storage(url)
    try:
        db.store.create_job(study_name=STUDY_NAME, space_path="x.yaml", space_yaml="", workload="ctr")
    finally:
        db.close()
    _sql(path, "UPDATE et_jobs SET settings = ?", value)
    # was: TypeError: 'int' object is not iterable, from dict(settings)
    _readers_say(url, path, capsys, "the stored et_jobs.settings of a row is", "not a mapping (damaged?)",
                 argvs=(["status"], ["export", "--study", STUDY_NAME, "-o", tmp_path / "best.yaml"]))
