"""Optuna's own schema check, with the head of its migrations read once per process: a database
at another Optuna schema revision is still refused with Optuna's advice, in one line."""

from __future__ import annotations

import sqlite3

import pytest
from optuna.storages._rdb.storage import _VersionManager

from erase_tune.errors import EraseTuneError
from erase_tune.store.storage import open_storage


def _set_optuna_revision(path, revision: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = ?", (revision,))


def test_opening_storages_reads_optunas_migrations_at_most_once(tmp_path, monkeypatch):
    for name in ("a.db", "b.db"):  # (Optuna reads them to stamp a new database: its own business)
        open_storage(f"sqlite:///{tmp_path / name}").close()
    calls = []
    real = _VersionManager._create_alembic_script
    monkeypatch.setattr(_VersionManager, "_create_alembic_script", lambda self: calls.append(1) or real(self))
    for name in ("a.db", "b.db", "a.db"):
        open_storage(f"sqlite:///{tmp_path / name}").close()
    assert calls == []  # Optuna's own check read them at every open


@pytest.mark.parametrize(("revision", "advice"), [("v3.0.0.d", "optuna storage upgrade"),  # an older Optuna's
                                                  ("v99.0.0", "pip install -U optuna")])  # a newer one's
def test_a_database_at_another_optuna_schema_is_refused_with_optunas_advice(tmp_path, revision, advice):
    path = tmp_path / "other.db"
    open_storage(f"sqlite:///{path}").close()
    open_storage(f"sqlite:///{path}").close()  # the head is known in this process now
    _set_optuna_revision(path, revision)
    with pytest.raises(EraseTuneError) as exc:
        open_storage(f"sqlite:///{path}")
    text = str(exc.value)
    assert "no longer compatible with the table schema" in text and advice in text and "\n" not in text
