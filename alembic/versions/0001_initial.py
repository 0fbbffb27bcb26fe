"""Initial erase-tune tables: jobs, trial measurements, baseline cache, exports.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Touch only erase-tune's own ``et_*`` tables: Optuna migrates its tables itself. Types are
spelled out here rather than imported from ``erase_tune.store.models``, so this revision
keeps meaning what it meant when the models change later.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def _timestamp() -> sa.DateTime:
    # Always UTC; on SQLite stored naive and made aware again by the models' UTCDateTime.
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "et_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_name", sa.String(length=512), nullable=False),
        sa.Column("space_path", sa.Text(), nullable=False),
        sa.Column("space_yaml", sa.Text(), nullable=False),
        sa.Column("workload", sa.String(length=512), nullable=False),
        sa.Column("settings", _json(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("n_trials_target", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.Column("updated_at", _timestamp(), nullable=False),
        sa.Column("finished_at", _timestamp(), nullable=True),
        sa.CheckConstraint(
            "status IN ('running', 'finished', 'failed', 'interrupted')", name=op.f("ck_et_jobs_status")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_et_jobs")),
        sa.UniqueConstraint("study_name", name=op.f("uq_et_jobs_study_name")),
    )
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
    op.create_table(
        "et_baseline_cache",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("metrics", _json(), nullable=False),
        sa.Column("samples", _json(), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_et_baseline_cache")),
        sa.UniqueConstraint("key", name=op.f("uq_et_baseline_cache_key")),
    )
    op.create_table(
        "et_exports",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("optuna_trial_number", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("plan_yaml", sa.Text(), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["et_jobs.id"], name=op.f("fk_et_exports_job_id_et_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_et_exports")),
    )
    op.create_index(op.f("ix_et_exports_job_id"), "et_exports", ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_et_exports_job_id"), table_name="et_exports")
    op.drop_table("et_exports")
    op.drop_table("et_baseline_cache")
    op.drop_table("et_trial_measurements")
    op.drop_table("et_jobs")
