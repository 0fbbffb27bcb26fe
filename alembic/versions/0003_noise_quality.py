"""The noise floor of each job's NE gap, and confirmations of quality (NE gap over seeds).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

``et_noise_floors``: the band within which a job's NE gaps are noise (erase_tune.measure.noise),
measured once before its trials and reused on resume. ``et_quality_confirmations``: a front
plan trained longer over several seeds before export, its NE gap with a 95% interval. Both
are new tables: nothing already stored changes, and the downgrade drops only them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "et_noise_floors",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("band", sa.Float(), nullable=False),
        sa.Column("ne_reference", sa.Float(), nullable=False),
        sa.Column("training_steps", sa.Integer(), nullable=False),
        sa.Column("repeats", sa.Integer(), nullable=False),
        sa.Column("gaps", _json(), nullable=False),
        sa.Column("provenance", _json(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["et_jobs.id"], name=op.f("fk_et_noise_floors_job_id_et_jobs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_et_noise_floors")),
    )
    op.create_index(op.f("ix_et_noise_floors_job_id"), "et_noise_floors", ["job_id"], unique=False)
    op.create_table(
        "et_quality_confirmations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.Column("plan_yaml", sa.Text(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("seeds", sa.Integer(), nullable=False),
        sa.Column("ne_gap", sa.Float(), nullable=False),
        sa.Column("ne_gap_lo", sa.Float(), nullable=False),
        sa.Column("ne_gap_hi", sa.Float(), nullable=False),
        sa.Column("detail", _json(), nullable=False),
        sa.Column("provenance", _json(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["et_jobs.id"],
                                name=op.f("fk_et_quality_confirmations_job_id_et_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_et_quality_confirmations")),
    )
    op.create_index(op.f("ix_et_quality_confirmations_job_id"), "et_quality_confirmations", ["job_id"],
                    unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_et_quality_confirmations_job_id"), table_name="et_quality_confirmations")
    op.drop_table("et_quality_confirmations")
    op.drop_index(op.f("ix_et_noise_floors_job_id"), table_name="et_noise_floors")
    op.drop_table("et_noise_floors")
