"""ORM tables for erase-tune's own data (jobs, trial outcomes, baseline cache, confirmations of
speed and of quality, noise floors, exports).

These tables live in the same database as Optuna's, so every name carries the ``et_`` prefix
and Alembic is told (``include_name``/``include_object`` below) to look at nothing else:
Optuna creates and migrates its own tables, and an autogenerate run or a downgrade here
must never propose to touch them.

The rows defined here never leave :mod:`erase_tune.store`; callers get the frozen value
objects of :mod:`erase_tune.store.repo`. Schema changes go through a new Alembic revision
in the top-level ``alembic/versions/`` directory; a test checks that the models and the
migrations agree.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    event,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from erase_tune.errors import EraseTuneError, shown

__all__ = [
    "TABLE_PREFIX",
    "VERSION_TABLE",
    "JOB_STATUSES",
    "OUTCOME_STATUSES",
    "FAILURE_KINDS",
    "Base",
    "JobRow",
    "TrialOutcomeRow",
    "ConfirmationRow",
    "BaselineRow",
    "ExportRow",
    "NoiseFloorRow",
    "QualityConfirmationRow",
    "include_name",
    "include_object",
]

TABLE_PREFIX = "et_"
VERSION_TABLE = "erase_tune_alembic_version"
"""Alembic's bookkeeping table for our revisions. Optuna keeps its own ``alembic_version``
in the same database, so ours must have a different name."""

JOB_STATUSES = ("running", "finished", "failed", "interrupted")
OUTCOME_STATUSES = ("complete", "failed")
FAILURE_KINDS = ("trial", "infra")
"""``trial``: the plan or workload failed (invalid plan, NaN, OOM, capture): recorded once.
``infra``: the worker, its node or its environment failed: retried, then recorded."""

# Deterministic constraint names: Alembic can only drop or alter a constraint it can name,
# and SQLite's batch mode needs the names to rebuild a table.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# jsonb on PostgreSQL (indexable, compact); plain JSON text elsewhere.
JSONType = JSON().with_variant(JSONB(), "postgresql")


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timezone-aware UTC datetime on every backend.

    PostgreSQL's ``timestamptz`` keeps the zone; SQLite has no zone type, so values are
    stored as naive UTC there and the zone is put back on the way out. Callers always see
    aware UTC datetimes, whatever the database.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; pass an aware (UTC) datetime")
        value = value.astimezone(dt.timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSONType, dt.datetime: UTCDateTime}


@event.listens_for(Base, "load", propagate=True)
def _json_columns_hold_mappings(row: Base, _context: Any) -> None:
    """Every JSON column is written as a mapping; one that holds something else (edited by hand,
    written by another program) is one line when it is read, not a TypeError where it is used."""
    for column in row.__table__.columns:
        value = getattr(row, column.key, None)
        if isinstance(column.type, JSON) and value is not None and not isinstance(value, dict):
            raise EraseTuneError(f"the stored {row.__tablename__}.{column.key} of a row is {shown(value)}, not a "
                                 "mapping (damaged?); nothing was changed")


class JobRow(Base):
    """One tuning job: an Optuna study plus what erase-tune needs to resume and report it."""

    __tablename__ = "et_jobs"
    __table_args__ = (CheckConstraint(_in("status", JOB_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_name: Mapped[str] = mapped_column(String(512), unique=True)
    space_path: Mapped[str] = mapped_column(Text)
    # The space file exactly as given, so a job can be resumed or audited after the file moved.
    space_yaml: Mapped[str] = mapped_column(Text)
    workload: Mapped[str] = mapped_column(String(512))
    settings: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16))
    n_trials_target: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime]
    updated_at: Mapped[dt.datetime]
    finished_at: Mapped[dt.datetime | None]


class _JobRecord:
    """The columns of a row a job keeps as its history: the row's key, the job (its rows go
    with it) and when the row was written. (``sort_order`` keeps a table's columns in the order
    its migration creates them: these first and last, the table's own between.)"""

    id: Mapped[int] = mapped_column(Integer, primary_key=True, sort_order=-4)
    job_id: Mapped[int] = mapped_column(ForeignKey("et_jobs.id", ondelete="CASCADE"), index=True, sort_order=-3)
    created_at: Mapped[dt.datetime] = mapped_column(sort_order=2)


class _TrialRecord(_JobRecord):
    """The columns of a row about one trial's plan, measured: the trial, the plan as YAML and
    the measurement's provenance."""

    trial_number: Mapped[int] = mapped_column(Integer, sort_order=-2)
    plan_yaml: Mapped[str] = mapped_column(Text, sort_order=-1)
    provenance: Mapped[dict[str, Any]] = mapped_column(sort_order=1)


class TrialOutcomeRow(_TrialRecord, Base):
    """What one trial's worker sent back beyond the scalar metrics (which live in the Optuna
    trial's user attributes): raw samples with their windows, provenance, the failure."""

    __tablename__ = "et_trial_outcomes"
    __table_args__ = (
        UniqueConstraint("job_id", "trial_number"),
        CheckConstraint(_in("status", OUTCOME_STATUSES), name="status"),
        CheckConstraint(f"failure_kind IS NULL OR {_in('failure_kind', FAILURE_KINDS)}", name="failure_kind"),
    )

    # No index of its own: the unique (job_id, trial_number) serves the job's lookups.
    job_id: Mapped[int] = mapped_column(ForeignKey("et_jobs.id", ondelete="CASCADE"), sort_order=-3)
    status: Mapped[str] = mapped_column(String(16))
    failure_kind: Mapped[str | None] = mapped_column(String(16))
    failure_reason: Mapped[str | None] = mapped_column(Text)
    traceback: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer)
    node: Mapped[str | None] = mapped_column(String(256))
    samples: Mapped[dict[str, Any]]


class ConfirmationRow(_TrialRecord, Base):
    """A second measurement of a front plan against its baseline, made before export."""

    __tablename__ = "et_confirmations"

    gain_over: Mapped[str] = mapped_column(String(16))
    windows: Mapped[int] = mapped_column(Integer)
    gain: Mapped[float] = mapped_column(Float)
    gain_lo: Mapped[float] = mapped_column(Float)
    gain_hi: Mapped[float] = mapped_column(Float)
    samples: Mapped[dict[str, Any]]


class NoiseFloorRow(_JobRecord, Base):
    """The noise floor of a job's NE gap (erase_tune.measure.noise), measured once before its trials."""

    __tablename__ = "et_noise_floors"

    band: Mapped[float] = mapped_column(Float)
    ne_reference: Mapped[float] = mapped_column(Float)
    training_steps: Mapped[int] = mapped_column(Integer)
    repeats: Mapped[int] = mapped_column(Integer)
    # {"gaps": [...], "kinds": [...]}: each perturbation's NE gap and what it was.
    gaps: Mapped[dict[str, Any]]
    provenance: Mapped[dict[str, Any]]


class QualityConfirmationRow(_TrialRecord, Base):
    """A front plan trained again over several data orders before export: its NE gap with an interval."""

    __tablename__ = "et_quality_confirmations"

    steps: Mapped[int] = mapped_column(Integer)
    seeds: Mapped[int] = mapped_column(Integer)
    ne_gap: Mapped[float] = mapped_column(Float)
    ne_gap_lo: Mapped[float] = mapped_column(Float)
    ne_gap_hi: Mapped[float] = mapped_column(Float)
    # {"per_seed": [...], "exact": bool, "band": float}: exact plans are not trained.
    detail: Mapped[dict[str, Any]]


class BaselineRow(Base):
    """A measured eager baseline, reused by trials with the same workload, args and device."""

    __tablename__ = "et_baseline_cache"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(64), unique=True)
    metrics: Mapped[dict[str, Any]]
    samples: Mapped[dict[str, Any]]
    created_at: Mapped[dt.datetime]


class ExportRow(_JobRecord, Base):
    """A plan file written by ``erase-tune export``, with the plan text as it was written."""

    __tablename__ = "et_exports"

    optuna_trial_number: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    plan_yaml: Mapped[str] = mapped_column(Text)


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Alembic reflection filter: look only at our tables, never at Optuna's (or anyone's)."""
    if type_ == "table":
        return bool(name) and name.startswith(TABLE_PREFIX)
    return True


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Alembic autogenerate filter; the second guard behind :func:`include_name`."""
    if type_ == "table":
        return bool(name) and name.startswith(TABLE_PREFIX)
    return True
