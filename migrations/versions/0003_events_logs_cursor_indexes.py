"""(job_id, id) indexes on job_events and log_lines: the SSE poller's start and every stream's catch-up read a job's
rows after a cursor, which the job_id-only indexes answered with a scan of that job's rows. They replace the
job_id-only indexes (a (job_id, id) index serves job_id lookups too).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 15:45:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("job_events", "log_lines"):
        op.create_index(f"ix_{table}_job_id_id", table, ["job_id", "id"])
        op.drop_index(f"ix_{table}_job_id", table_name=table)


def downgrade() -> None:
    for table in ("job_events", "log_lines"):
        op.create_index(f"ix_{table}_job_id", table, ["job_id"])
        op.drop_index(f"ix_{table}_job_id_id", table_name=table)
