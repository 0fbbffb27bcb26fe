"""A database that is not (all) an erase-tune storage: a command that would write there refuses
another application's database, and one that only reads refuses a storage missing some of
Optuna's tables, in one line, changing nothing (issue 30)."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from tests.tune.conftest import SMOKE, run_cli
from tests.tune.studies import STUDY_NAME, write_finished_study
from tests.tune.test_cli_errors import one_error_line


def _bytes(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("argv", [
    ["db", "upgrade"],
    ["start", "--space", str(SMOKE), "--no-confirm"],  # refused before Ray starts (it took 45 s to run a job there)
])
def test_a_writer_refuses_another_applications_sqlite_file(tmp_path, capsys, argv):
    db = tmp_path / "notes.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.execute("INSERT INTO notes VALUES ('my notes')")
    conn.commit()
    conn.close()
    before = _bytes(db)
    assert run_cli(*argv, "--storage", f"sqlite:///{db}") == 2  # was: 20 tables created beside 'notes'
    one_error_line(capsys.readouterr().err, "is a database of another application (1 table: notes;",
                   "nothing was changed")
    assert _bytes(db) == before and sorted(p.name for p in tmp_path.iterdir()) == ["notes.db"]


def test_a_writer_refuses_another_applications_postgres_database(pg_url, capsys):
    from sqlalchemy import create_engine, inspect
    from sqlalchemy.pool import NullPool

    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE invoices (id INT)")
    try:
        assert run_cli("db", "upgrade", "--storage", pg_url) == 2
        one_error_line(capsys.readouterr().err, "is a database of another application (1 table: invoices;")
        assert inspect(engine).get_table_names() == ["invoices"]
    finally:
        engine.dispose()


def test_an_empty_database_is_still_set_up(tmp_path):
    db = tmp_path / "empty.db"
    db.write_bytes(b"")
    assert run_cli("db", "upgrade", "--storage", f"sqlite:///{db}") == 0


@pytest.mark.parametrize("table", ["trial_user_attributes", "study_user_attributes", "trial_values", "trial_params"])
def test_a_reader_refuses_a_storage_missing_one_of_optunas_tables(tmp_path, capsys, table):
    url = write_finished_study(tmp_path / "s.db", gain_over="eager")
    assert run_cli("db", "upgrade", "--storage", url) == 0
    conn = sqlite3.connect(tmp_path / "s.db")
    conn.execute(f"DROP TABLE {table}")
    conn.commit()
    conn.close()
    capsys.readouterr()
    before = _bytes(tmp_path / "s.db")
    for argv in (["status"], ["status", "--study", STUDY_NAME, "--trial", "3"], ["db", "current"],
                 ["report", "--study", STUDY_NAME, "-o", tmp_path / "rep"]):
        assert run_cli(*argv, "--storage", url) == 2, argv  # was: exit 0, the table made again by the reader
        one_error_line(capsys.readouterr().err, f"lacks Optuna's table(s) {table} (dropped?)", "nothing was changed")
    assert _bytes(tmp_path / "s.db") == before
    assert run_cli("db", "upgrade", "--storage", url) == 0  # what the line advises: the table is back, empty
    assert run_cli("status", "--study", STUDY_NAME, "--storage", url) == 0


def test_reading_a_plain_optuna_storage_leaves_its_journal_mode(tmp_path, capsys):
    """status on a SQLite file Optuna made itself (rollback journal) turned it into a WAL database."""
    import optuna

    path = tmp_path / "plain.db"
    storage = optuna.storages.RDBStorage(f"sqlite:///{path}")
    optuna.create_study(storage=storage, study_name="plain", direction="minimize").optimize(
        lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    storage.engine.dispose()
    before = _bytes(path)
    for argv, code in ((["status"], 2), (["status", "--study", "plain", "--trial", "0"], 2), (["db", "current"], 0),
                       (["report", "--study", "plain", "-o", tmp_path / "rep"], 2)):
        assert run_cli(*argv, "--storage", f"sqlite:///{path}") == code, argv  # 2: not an erase-tune job
        capsys.readouterr()
    assert _bytes(path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["plain.db"]
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
