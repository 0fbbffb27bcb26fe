"""Alembic migrations of erase-tune's tables, on SQLite and PostgreSQL, beside Optuna's.

The central promise: our upgrades and downgrades touch only ``et_*`` tables and our own
version table, so a database that Optuna already uses keeps working throughout.
"""

from __future__ import annotations

import logging

import optuna
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool

from erase_tune.errors import EraseTuneError
from erase_tune.store import (
    OutcomeRecord,
    QualityRecord,
    SchemaError,
    Store,
    VERSION_TABLE,
    head_revision,
    upgrade_sql,
)
from erase_tune.store.migrate import scripts_dir
from erase_tune.store.models import Base, include_name, include_object

OUR_TABLES = {"et_jobs", "et_trial_outcomes", "et_confirmations", "et_baseline_cache", "et_exports",
              "et_noise_floors", "et_quality_confirmations"}


def table_names(url: str) -> set[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def optuna_version(url: str) -> list[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [r[0] for r in conn.execute(text("SELECT version_num FROM alembic_version"))]
    finally:
        engine.dispose()


def optuna_study(url: str, n_trials: int) -> int:
    """Run ``n_trials`` more trials of an unrelated Optuna study; return its trial count."""
    optuna.logging.set_verbosity(logging.WARNING)
    storage = optuna.storages.RDBStorage(url)
    try:
        study = optuna.create_study(storage=storage, study_name="unrelated", load_if_exists=True)
        study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0) ** 2, n_trials=n_trials)
        return len(study.trials)
    finally:
        storage.remove_session()
        storage.engine.dispose()


def test_scripts_are_found_with_one_head() -> None:
    assert (scripts_dir() / "env.py").is_file()
    assert head_revision() == "0003"


def test_upgrade_downgrade_upgrade_leaves_optuna_alone(storage_url: str) -> None:
    assert optuna_study(storage_url, n_trials=2) == 2
    optuna_tables, optuna_rev = table_names(storage_url), optuna_version(storage_url)
    assert "studies" in optuna_tables and "alembic_version" in optuna_tables and optuna_rev

    with Store(storage_url) as store:
        store.upgrade()
        assert store.schema_version().revision == head_revision()
        store.check_schema()
        assert table_names(storage_url) == optuna_tables | OUR_TABLES | {VERSION_TABLE}
        assert optuna_version(storage_url) == optuna_rev
        job = store.create_job(study_name="unrelated", space_path="s.yaml", space_yaml="", workload="mlp")
        store.record_outcome(job, 0, OutcomeRecord(
            plan_yaml="", status="complete"))
        assert optuna_study(storage_url, n_trials=1) == 3  # Optuna is fine with our tables beside

        store.downgrade()
        assert store.schema_version().revision is None and store.schema_version().state == "none"
        # Alembic keeps its (now empty) version table at base; everything else of ours is gone.
        assert table_names(storage_url) == optuna_tables | {VERSION_TABLE}
        assert optuna_version(storage_url) == optuna_rev
        assert optuna_study(storage_url, n_trials=1) == 4
        with pytest.raises(SchemaError, match="revision none"):
            store.get_job("unrelated")

        store.upgrade()
        assert store.schema_version().revision == head_revision() and store.schema_version().state == "current"
        assert store.list_jobs() == []  # a fresh schema, usable again
        store.create_job(study_name="unrelated", space_path="s.yaml", space_yaml="", workload="mlp")
        assert optuna_study(storage_url, n_trials=1) == 5

        store.downgrade("-1")  # an older erase-tune's schema: one this one migrates
        older = store.schema_version()
        assert older.state == "behind" and older.known and older.revision not in (None, head_revision())
        assert older.problem("URL") == (f"database at revision {older.revision}, erase-tune needs {head_revision()}: "
                                        "run `erase-tune db upgrade --storage URL`")
        with pytest.raises(SchemaError, match="run `erase-tune db upgrade"):
            store.check_schema()
        store.upgrade()
        assert store.schema_version().state == "current"


def test_upgrade_is_idempotent(migrated: Store, storage_url: str) -> None:
    before = table_names(storage_url)
    migrated.upgrade()
    assert table_names(storage_url) == before and migrated.schema_version().revision == head_revision()


def test_models_and_migrations_agree(migrated: Store, storage_url: str) -> None:
    """Autogenerate against the migrated database finds nothing to do, even with Optuna's
    tables present: the migrations match the models, and the filters hide Optuna's tables."""
    optuna_study(storage_url, n_trials=1)
    engine = create_engine(storage_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={
                "version_table": VERSION_TABLE, "include_name": include_name,
                "include_object": include_object, "compare_type": True, "target_metadata": Base.metadata,
            })
            assert compare_metadata(ctx, Base.metadata) == []
            # Without the filters autogenerate would want to drop Optuna's tables.
            bare = MigrationContext.configure(conn, opts={"target_metadata": Base.metadata})
            assert any(d[0] == "remove_table" for d in compare_metadata(bare, Base.metadata))
    finally:
        engine.dispose()


def test_database_newer_than_this_erase_tune(migrated: Store, storage_url: str) -> None:
    engine = create_engine(storage_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999_future'"))
    engine.dispose()
    with pytest.raises(SchemaError, match="9999_future, which this erase-tune does not know.*upgrade erase-tune"):
        migrated.check_schema()
    version = migrated.schema_version()
    assert (version.revision, version.state, version.known) == ("9999_future", "ahead", False)
    with pytest.raises(SchemaError, match="9999_future, which this erase-tune does not know.*upgrade erase-tune"):
        migrated.upgrade()  # not Alembic's "Can't locate revision"


def test_two_rows_in_the_version_table_are_one_line_not_a_traceback(migrated: Store, storage_url: str) -> None:
    engine = create_engine(storage_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES ('0001')"))
    engine.dispose()
    for call in (migrated.check_schema, migrated.upgrade):
        with pytest.raises(SchemaError, match=f"version table {VERSION_TABLE} holds 2 revisions "
                                              f"\\(0001, {head_revision()}\\); a database is at one"):
            call()


def test_offline_sql_names_only_our_tables() -> None:
    sql = upgrade_sql("postgresql+psycopg://tuner:hunter2@db/et")
    assert "CREATE TABLE et_jobs" in sql and f"CREATE TABLE {VERSION_TABLE}" in sql
    assert "jsonb" in sql.lower() and "alembic_version " not in sql.replace(VERSION_TABLE, "")
    assert "hunter2" not in sql


def test_failed_upgrade_leaves_nothing_half_done(store: Store, storage_url: str) -> None:
    """The whole upgrade runs in one transaction (SQLite included, see store/engine.py)."""
    engine = create_engine(storage_url, poolclass=NullPool)
    with engine.begin() as conn:  # a squatter on the name of the last table 0001 creates
        conn.execute(text("CREATE TABLE et_exports (squatter INTEGER)"))
    engine.dispose()
    with pytest.raises(EraseTuneError, match="database upgrade failed on .*et_exports") as info:
        store.upgrade()
    assert "\n" not in str(info.value)
    assert table_names(storage_url) == {"et_exports"}
    assert store.schema_version().revision is None


def test_0002_carries_trial_measurements_over_and_back(store: Store, storage_url: str) -> None:
    """Rows measured under 0001 become outcomes (samples with unknown windows), and back."""
    store.upgrade("0001")
    engine = create_engine(storage_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO et_jobs (study_name, space_path, space_yaml, workload, settings, status, "
                          "created_at, updated_at) VALUES ('old', 's.yaml', '', 'ctr', '{}', 'finished', "
                          "'2026-11-30 10:00:00', '2026-11-30 10:00:00')"))
        conn.execute(text("INSERT INTO et_trial_measurements (job_id, optuna_trial_number, plan_yaml, status, "
                          "failure_reason, metrics, samples, device, ray_node, duration_s, created_at) VALUES "
                          "(1, 5, 'cuts: []', 'complete', NULL, '{\"gain_p90\": 0.1}', "
                          "'{\"baseline\": [0.01, 0.02]}', 'NVIDIA H200', 'n1', 12.5, '2026-11-30 10:00:00')"))
    engine.dispose()
    store.upgrade()
    job = store.get_job("old")
    o = store.outcome(job, 5)
    assert o.status == "complete" and o.node == "n1" and o.attempts == 1
    assert o.samples == {"baseline": {"steps_s": [0.01, 0.02], "window": None}}
    assert o.provenance == {"device_name": "NVIDIA H200", "duration_s": 12.5}
    store.downgrade("0001")
    engine = create_engine(storage_url, poolclass=NullPool)
    with engine.connect() as conn:
        row = conn.execute(text("SELECT optuna_trial_number, samples, device FROM et_trial_measurements")).one()
    engine.dispose()
    assert row[0] == 5 and row[2] == "NVIDIA H200"


def test_0003_adds_noise_floors_and_quality_and_keeps_what_is_stored(store: Store, storage_url: str) -> None:
    store.upgrade()
    job = store.create_job(study_name="kept", space_path="s.yaml", space_yaml="", workload="mlp")
    store.record_outcome(job, 0, OutcomeRecord(
        plan_yaml="cuts: []", status="complete"))
    floor = store.record_noise_floor(job, {"band": 0.02, "gaps": [0.01, -0.02], "kinds": ["order", "graph"],
                                           "ne_reference": 0.8, "training_steps": 40, "repeats": 1})
    assert store.noise_floor(job) == floor and floor.kinds == ("order", "graph") and floor.band == 0.02
    q = store.record_quality(job, 0, QualityRecord(
        plan_yaml="cuts: []", steps=160, seeds=3, ne_gap=0.01, ne_gap_lo=-0.01, ne_gap_hi=0.03,
        per_seed=[0.0, 0.01, 0.02], exact=False, band=0.02, provenance={}))
    assert store.quality_confirmations(job) == [q] and q.per_seed == (0.0, 0.01, 0.02)
    store.downgrade("0002")
    tables = table_names(storage_url)
    assert "et_noise_floors" not in tables and "et_quality_confirmations" not in tables
    engine = create_engine(storage_url, poolclass=NullPool)
    with engine.connect() as conn:  # what 0002 held is still there
        assert conn.execute(text("SELECT count(*) FROM et_trial_outcomes")).scalar() == 1
    engine.dispose()
    store.upgrade()
    assert store.noise_floor(job) is None and store.outcome(job, 0) is not None
