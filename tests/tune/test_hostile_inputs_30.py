"""Hostile and careless command lines (issue 30): each is one line, exit 2, before anything runs,
and nothing already stored or written is touched.

- ``export -o``: a path that names a directory (``old.yaml/``, ``newdir/``, an existing
  directory) or lies in a directory that is not there (or is a file);
- ``start --repeats 1`` / ``export --repeats 0``, ``export --max-ne-gap inf|nan|-0.1``;
- a workload spec naming something that is not a workload factory (``builtins:exit``),
  or spelled with white space around it;
- a storage URL with white space around it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import textwrap
from pathlib import Path

import pytest

from erase_tune.errors import EraseTuneError
from erase_tune.tune.views.export import ConfirmSettings, export_plan
from tests.tune.conftest import SMOKE, run_cli
from tests.tune.studies import STUDY_NAME, write_finished_study
from tests.tune.test_cli_errors import one_error_line


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (names with odd characters too) and a digest of its bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root) + "/"] = "dir"
        for name in filenames:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


@pytest.fixture
def study(tmp_path) -> dict:
    """A finished study in a SQLite file, a plan file that is already there, and an empty directory."""
    url = write_finished_study(tmp_path / "s.db", gain_over="eager")
    (tmp_path / "old.yaml").write_text("cuts: []  # my earlier plan\n")
    (tmp_path / "plans").mkdir()
    return {"url": url, "root": tmp_path}


def _export(study: dict, *argv: object) -> int:
    return run_cli("export", "--study", STUDY_NAME, "--storage", study["url"], *argv)


# -- export -o ---------------------------------------------------------------------------


@pytest.mark.parametrize(("out", "named", "needle"), [
    ("old.yaml/", "old.yaml/", "names a directory"),  # was: old.yaml replaced, exit 0
    ("newdir/", "newdir/", "names a directory"),  # was: a regular file named newdir
    ("newdir/.", "newdir/.", "names a directory"),
    ("plans/", "plans/", "names a directory"),
    ("plans", "plans", "is a directory"),
    ("missing/best.yaml", "missing", "does not exist"),
    ("old.yaml/best.yaml", "old.yaml/best.yaml", "Not a directory"),  # the "directory" is a file
])
def test_export_to_a_path_that_is_no_file_to_write_is_one_line_and_writes_nothing(study, capsys, monkeypatch,
                                                                                    out, named, needle):
    root = study["root"]
    monkeypatch.chdir(root)  # the paths as a user types them, relative, trailing slash kept
    before = _tree(root)
    assert _export(study, "--max-ne-gap", "1", "-o", out) == 2
    one_error_line(capsys.readouterr().err, "-o: ", named, needle)
    assert _tree(root) == before  # old.yaml byte for byte, the database, no new file or directory


def test_export_into_a_directory_it_cannot_write_is_one_line(study, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: the permission cannot be tested as root")
    locked = study["root"] / "plans"
    locked.chmod(0o555)
    try:
        assert _export(study, "-o", locked / "best.yaml") == 2
        one_error_line(capsys.readouterr().err, str(locked), "not writable")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


# -- option values -----------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "needle"), [
    (["--repeats", "0"], "--repeats: 0 must be an integer in 2..1000"),
    (["--repeats", "-3"], "--repeats: -3 must be an integer in 2..1000"),
    (["--repeats", "1"], "--repeats: 1 must be an integer in 2..1000"),
    (["--repeats", "1001"], "--repeats: 1001 must be an integer in 2..1000"),
    (["--max-ne-gap", "inf"], "--max-ne-gap: inf must be between 0 and 100"),
    (["--max-ne-gap", "nan"], "--max-ne-gap: nan must be between 0 and 100"),
    (["--max-ne-gap", "-0.1"], "--max-ne-gap: -0.1 must be between 0 and 100"),
    (["--max-ne-gap", "-1"], "--max-ne-gap: -1.0 must be between 0 and 100"),
    (["--max-ne-gap", "1e9"], "must be between 0 and 100"),
])
def test_export_option_out_of_range_is_refused_before_anything(study, capsys, argv, needle):
    root = study["root"]
    before = _tree(root)
    assert _export(study, *argv, "-o", root / "best.yaml") == 2
    one_error_line(capsys.readouterr().err, needle)
    assert _tree(root) == before


@pytest.mark.parametrize("gap", [0.0, 100.0])
def test_export_budget_bounds_themselves_are_accepted(study, gap):
    """The range's ends pass the check: export goes on to the study (whose front is not confirmed)."""
    with pytest.raises(EraseTuneError, match="front is not confirmed yet|no trial of study"):
        export_plan(study["url"], STUDY_NAME, study["root"] / "best.yaml", max_ne_gap=gap,
                    confirm=ConfirmSettings(windows=2))


@pytest.mark.parametrize(("argv", "needle"), [
    (["--repeats", "1"], "--repeats: 1 must be an integer in 2..1000"),
    (["--repeats", "-1"], "--repeats: -1 must be an integer in 2..1000"),
    (["--repeats", "1000000000"], "--repeats: 1000000000 must be an integer in 2..1000"),
    (["--repeats", "0"], "--no-confirm"),
])
def test_start_repeats_is_refused_before_any_trial(tmp_path, capsys, argv, needle):
    db = tmp_path / "start.db"
    assert run_cli("start", "--space", SMOKE, "--study", "r", "--storage", f"sqlite:///{db}", *argv) == 2
    one_error_line(capsys.readouterr().err, needle)
    assert not db.exists()  # refused before the storage was even opened, so before any trial


def test_start_without_confirmation_ignores_repeats(tmp_path):
    """--no-confirm asks for no confirmation: its --repeats is not checked (JobSpec gets 0)."""
    from erase_tune.tune.run.job import JobSpec

    assert JobSpec(confirm_windows=0).confirm_windows == 0
    for bad in (1, -1, True, 2.5):
        with pytest.raises(EraseTuneError, match="--repeats"):
            JobSpec(confirm_windows=bad)


# -- workloads -----------------------------------------------------------------------------


@pytest.fixture
def plan(tmp_path) -> Path:
    p = tmp_path / "plan.yaml"
    p.write_text("cuts: []\n")
    return p


@pytest.mark.parametrize(("workload", "needle"), [
    ("builtins:exit", "not a workload factory"),  # was: exit 0, nothing run
    ("sys:exit", "not a workload factory"),
    ("os:abort", "not a workload factory"),  # would kill the process
    ("builtins:print", "not a workload factory"),
    ("builtins:dict", "not a workload factory"),
    ("ctr\n", "unknown workload 'ctr\\n'"),
    (" ctr", "unknown workload ' ctr'"),
    ("tests.tune.faulty:workload\n", "not of the form"),
    ("tests.tune.faulty :workload", "not of the form"),
    ("tests.tune.faulty:workload  ", "not of the form"),
])
def test_a_workload_that_is_no_workload_factory_is_one_line(plan, capsys, workload, needle):
    assert run_cli("trial", "--workload", workload, "--plan", plan, "--device", "cpu") == 2
    one_error_line(capsys.readouterr().err, needle)


def test_a_factory_that_exits_the_program_is_one_line(tmp_path, plan, capsys, monkeypatch):
    (tmp_path / "quitter_30.py").write_text(textwrap.dedent("""
        import sys

        def workload():
            sys.exit(0)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "quitter_30", raising=False)
    assert run_cli("trial", "--workload", "quitter_30:workload", "--plan", plan, "--device", "cpu") == 2
    one_error_line(capsys.readouterr().err, "quitter_30:workload", "exited", "not a workload factory")


# -- storage URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize("pad", [" ", "\n", "\t", "  "])
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_storage_url_with_white_space_around_it_is_refused(study, capsys, pad, where):
    root = study["root"]
    url = study["url"] + pad if where == "after" else pad + study["url"]
    before = _tree(root)
    for argv in (["status", "--storage", url], ["status", "--study", STUDY_NAME, "--storage", url],
                 ["report", "--study", STUDY_NAME, "--storage", url, "-o", root / "rep"],
                 ["db", "upgrade", "--storage", url],
                 ["start", "--space", SMOKE, "--study", "w", "--storage", url]):
        assert run_cli(*argv) == 2, argv
        one_error_line(capsys.readouterr().err, "storage URL", "white space")
    assert _tree(root) == before  # no file "s.db " beside s.db, and s.db untouched


def test_a_new_storage_url_with_a_trailing_space_creates_no_file(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'new.db'} "
    assert run_cli("db", "upgrade", "--storage", url) == 2
    one_error_line(capsys.readouterr().err, "white space")
    assert list(tmp_path.iterdir()) == []


# -- read-only commands on what is not an erase-tune study or storage ------------------------


def test_status_of_a_trial_of_a_plain_optuna_study_is_one_line(study, capsys):
    """A single-objective study made with Optuna itself, beside an erase-tune job in one storage."""
    import optuna

    plain = optuna.create_study(storage=study["url"], study_name="plain", direction="minimize")
    plain.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert run_cli("db", "upgrade", "--storage", study["url"]) == 0  # as a job leaves it: reading then writes nothing
    before = _tree(study["root"])
    for argv in (["--trial", "0"], ["--trial", "1", "--json"], []):
        assert run_cli("status", "--study", "plain", "--storage", study["url"], *argv) == 2, argv
        one_error_line(capsys.readouterr().err, "study 'plain' is not an erase-tune job", "(minimize)")
    assert run_cli("report", "--study", "plain", "--storage", study["url"], "-o", study["root"] / "rep") == 2
    one_error_line(capsys.readouterr().err, "study 'plain' is not an erase-tune job")
    assert _tree(study["root"]) == before
    assert run_cli("status", "--study", STUDY_NAME, "--storage", study["url"], "--trial", "0") == 0  # ours still shows


def _foreign(kind: str, path: Path) -> None:
    import sqlite3

    if kind == "other tables":
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.execute("INSERT INTO notes VALUES ('my notes')")
        conn.commit()
        conn.close()
    elif kind == "empty file":
        path.write_bytes(b"")
    else:
        path.write_text("not a database at all\n" * 100)


@pytest.mark.parametrize("kind", ["other tables", "empty file", "text"])
def test_reading_a_sqlite_file_that_is_not_an_erase_tune_storage_changes_nothing(tmp_path, capsys, kind):
    db = tmp_path / "other.db"
    _foreign(kind, db)
    url = f"sqlite:///{db}"
    before = _tree(tmp_path)
    for argv in (["status"], ["status", "--study", "s"], ["status", "--study", "s", "--trial", "0"],
                 ["report", "--study", "s", "-o", tmp_path / "rep"], ["db", "current"],
                 ["export", "--study", "s", "-o", tmp_path / "best.yaml"]):  # export needs a study there too
        assert run_cli(*argv, "--storage", url) == 2, argv
        line = one_error_line(capsys.readouterr().err, str(db))
        assert ("not an erase-tune storage" in line) if kind != "text" else ("not a database" in line), line
    assert _tree(tmp_path) == before  # byte for byte: no Optuna tables, no WAL, no lock or journal file


def test_reading_a_postgres_database_that_is_not_an_erase_tune_storage_creates_no_table(pg_url, capsys, tmp_path):
    from sqlalchemy import create_engine, inspect
    from sqlalchemy.pool import NullPool

    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE notes (body TEXT)")
    try:
        for argv in (["status"], ["status", "--study", "s", "--trial", "0"], ["db", "current"],
                     ["export", "--study", "s", "-o", tmp_path / "best.yaml"]):
            assert run_cli(*argv, "--storage", pg_url) == 2, argv
            one_error_line(capsys.readouterr().err, "not an erase-tune storage")
        assert inspect(engine).get_table_names() == ["notes"]
    finally:
        engine.dispose()


@pytest.mark.parametrize("pad", [" ", "\n"])
@pytest.mark.parametrize("flag", ["--py-module", "--working-dir"])
def test_a_shipped_directory_with_white_space_after_it_is_refused_visibly(tmp_path, capsys, pad, flag):
    (tmp_path / "pkg").mkdir()
    db = tmp_path / "start.db"
    given = str(tmp_path / "pkg") + pad
    assert run_cli("start", "--space", SMOKE, "--study", "w", "--storage", f"sqlite:///{db}",
                   "--ray-address", "127.0.0.1:1", flag, given) == 2
    one_error_line(capsys.readouterr().err, repr(given), "does not exist")  # quoted: the space shows
    assert not db.exists()


@pytest.mark.parametrize("query", ["?mode=ro", "?mode=rw", "?mode=ro&uri=true", "?immutable=1", "?cache=shared",
                                   "?timeout=0"])
def test_sqlite_options_in_a_storage_url_are_refused(study, capsys, query):
    """pysqlite ignored ?mode=ro without uri=true (db upgrade wrote to the 'read-only' file), and
    with it read the path as a URI (status called the study's storage an empty database)."""
    root = study["root"]
    before = _tree(root)
    for argv in (["status"], ["db", "current"], ["db", "upgrade"],
                 ["start", "--space", SMOKE, "--study", "w", "--ray-address", "127.0.0.1:1"]):
        assert run_cli(*argv, "--storage", study["url"] + query) == 2, argv
        one_error_line(capsys.readouterr().err, "SQLite options in the URL", f"sqlite:///{root / 's.db'}")
    assert _tree(root) == before


@pytest.mark.parametrize("char", ["\u200b", "\ufeff", "\x1b", "\u202e"])
def test_a_storage_url_with_an_invisible_character_is_refused(tmp_path, capsys, char):
    """It named another file: db upgrade made 's.db\\u200b' beside the s.db the user meant."""
    url = f"sqlite:///{tmp_path / 's.db'}{char}"
    assert run_cli("db", "upgrade", "--storage", url) == 2
    one_error_line(capsys.readouterr().err, "invisible or control character", char.encode("unicode_escape").decode())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_start_with_a_journal_it_cannot_write_is_one_line_before_anything(tmp_path, capsys, monkeypatch, where):
    """Was: found when the first trial's outcome was journaled, the job ending in a traceback."""
    (tmp_path / "afile").write_text("")
    journal = tmp_path / "afile" / "journal" if where == "under-a-file" else Path("/proc/erase-tune-journal")
    monkeypatch.setenv("ERASE_TUNE_JOURNAL_DIR", str(journal))
    db = tmp_path / "start.db"
    assert run_cli("start", "--space", SMOKE, "--study", "j", "--storage", f"sqlite:///{db}",
                   "--ray-address", "127.0.0.1:1") == 2
    one_error_line(capsys.readouterr().err, "$ERASE_TUNE_JOURNAL_DIR: cannot write in", str(journal))
    assert not db.exists()
