"""Workers register what they can run (admission refuses specs no live worker could run), and API tokens carry
their own admin flag (a token of an admin user is an admin token only when made so). Tokens that existed before
keep the role they had: those of admin users become admin tokens.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 13:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("queues", sa.JSON(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("gpu_memory_gb", sa.Float(), nullable=False),
        sa.Column("host_memory_gb", sa.Float(), nullable=False),
        sa.Column("cuda", sa.String(length=50), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.execute("UPDATE api_tokens SET admin = (SELECT users.is_admin FROM users WHERE users.id = api_tokens.user_id)")
    with op.batch_alter_table("api_tokens") as batch:
        batch.alter_column("admin", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("admin")
    op.drop_table("workers")
