"""Trial outcomes (raw samples with windows, provenance, failure kind and traceback) replace
trial measurements; confirmations (the second look before export) are kept.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

The scalar metrics of a trial live in its Optuna user attributes; ``et_trial_measurements``
kept a second copy of them that nothing read. Its rows are carried over into
``et_trial_outcomes`` (samples gain a ``window`` list, unknown for old rows: null; device,
node and duration go into ``provenance``), so nothing already stored is lost, and the
downgrade carries them back.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def _timestamp() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def _measurements() -> sa.Table:
    return sa.table(
        "et_trial_measurements",
        sa.column("job_id", sa.Integer), sa.column("optuna_trial_number", sa.Integer),
        sa.column("plan_yaml", sa.Text), sa.column("status", sa.String), sa.column("failure_reason", sa.Text),
        sa.column("metrics", _json()), sa.column("samples", _json()), sa.column("device", sa.String),
        sa.column("ray_node", sa.String), sa.column("duration_s", sa.Float), sa.column("created_at", _timestamp()),
    )


def _outcomes() -> sa.Table:
    return sa.table(
        "et_trial_outcomes",
        sa.column("job_id", sa.Integer), sa.column("trial_number", sa.Integer), sa.column("plan_yaml", sa.Text),
        sa.column("status", sa.String), sa.column("failure_kind", sa.String), sa.column("failure_reason", sa.Text),
        sa.column("traceback", sa.Text), sa.column("attempts", sa.Integer), sa.column("node", sa.String),
        sa.column("samples", _json()), sa.column("provenance", _json()), sa.column("created_at", _timestamp()),
    )


def upgrade() -> None:
    op.create_table(
        "et_trial_outcomes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.Column("plan_yaml", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("failure_kind", sa.String(length=16), nullable=True),
        sa.Column("failure_reason", sa.Text(), nullable=True),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=256), nullable=True),
        sa.Column("samples", _json(), nullable=False),
        sa.Column("provenance", _json(), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.CheckConstraint("status IN ('complete', 'failed')", name=op.f("ck_et_trial_outcomes_status")),
        sa.CheckConstraint("failure_kind IS NULL OR failure_kind IN ('trial', 'infra')",
                           name=op.f("ck_et_trial_outcomes_failure_kind")),
        sa.ForeignKeyConstraint(["job_id"], ["et_jobs.id"], name=op.f("fk_et_trial_outcomes_job_id_et_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_et_trial_outcomes")),
        sa.UniqueConstraint("job_id", "trial_number", name=op.f("uq_et_trial_outcomes_job_id_trial_number")),
    )
    op.create_table(
        "et_confirmations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.Column("plan_yaml", sa.Text(), nullable=False),
        sa.Column("gain_over", sa.String(length=16), nullable=False),
        sa.Column("windows", sa.Integer(), nullable=False),
        sa.Column("gain", sa.Float(), nullable=False),
        sa.Column("gain_lo", sa.Float(), nullable=False),
        sa.Column("gain_hi", sa.Float(), nullable=False),
        sa.Column("samples", _json(), nullable=False),
        sa.Column("provenance", _json(), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["et_jobs.id"], name=op.f("fk_et_confirmations_job_id_et_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_et_confirmations")),
    )
    op.create_index(op.f("ix_et_confirmations_job_id"), "et_confirmations", ["job_id"], unique=False)

    # Offline (SQL for a DBA to review) there is no data to carry: only the schema changes.
    old = [] if op.get_context().as_sql else op.get_bind().execute(sa.select(_measurements())).mappings().all()
    rows = [{
        "job_id": r["job_id"], "trial_number": r["optuna_trial_number"], "plan_yaml": r["plan_yaml"],
        "status": "complete" if r["status"] == "complete" else "failed",
        "failure_kind": None if r["status"] == "complete" else "trial", "failure_reason": r["failure_reason"],
        "traceback": None, "attempts": 1, "node": r["ray_node"],
        "samples": {k: {"steps_s": v, "window": None} for k, v in (r["samples"] or {}).items()},
        "provenance": {"device_name": r["device"], "duration_s": r["duration_s"]},
        "created_at": r["created_at"],
    } for r in old]
    if rows:
        op.bulk_insert(_outcomes(), rows)
    op.drop_table("et_trial_measurements")


def downgrade() -> None:
    op.create_table(
        "et_trial_measurements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("optuna_trial_number", sa.Integer(), nullable=False),
        sa.Column("plan_yaml", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("failure_reason", sa.Text(), nullable=True),
        sa.Column("metrics", _json(), nullable=False),
        sa.Column("samples", _json(), nullable=False),
        sa.Column("device", sa.String(length=256), nullable=True),
        sa.Column("ray_node", sa.String(length=256), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.CheckConstraint(
            "status IN ('complete', 'failed', 'pruned')", name=op.f("ck_et_trial_measurements_status")
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["et_jobs.id"], name=op.f("fk_et_trial_measurements_job_id_et_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_et_trial_measurements")),
        sa.UniqueConstraint(
            "job_id", "optuna_trial_number", name=op.f("uq_et_trial_measurements_job_id_optuna_trial_number")
        ),
    )
    new = [] if op.get_context().as_sql else op.get_bind().execute(sa.select(_outcomes())).mappings().all()
    rows = [{
        "job_id": r["job_id"], "optuna_trial_number": r["trial_number"], "plan_yaml": r["plan_yaml"],
        "status": r["status"], "failure_reason": r["failure_reason"], "metrics": {},
        "samples": {k: v.get("steps_s", []) for k, v in (r["samples"] or {}).items()},
        "device": (r["provenance"] or {}).get("device_name"), "ray_node": r["node"],
        "duration_s": (r["provenance"] or {}).get("duration_s"),
        "created_at": r["created_at"] or dt.datetime.now(dt.timezone.utc),
    } for r in new]
    if rows:
        op.bulk_insert(_measurements(), rows)
    op.drop_index(op.f("ix_et_confirmations_job_id"), table_name="et_confirmations")
    op.drop_table("et_confirmations")
    op.drop_table("et_trial_outcomes")
