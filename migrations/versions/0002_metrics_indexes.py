"""Indexes on metrics for the dashboard feeds: (job_id, id) for the SSE cursor and its replay, (job_id, name, step)
for one series by step and the job list's latest timing_s/step.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 11:45:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_metrics_job_id_id", "metrics", ["job_id", "id"])
    op.create_index("ix_metrics_job_name_step", "metrics", ["job_id", "name", "step"])


def downgrade() -> None:
    op.drop_index("ix_metrics_job_name_step", table_name="metrics")
    op.drop_index("ix_metrics_job_id_id", table_name="metrics")
