"""What the persistence modules share: their errors and the dialect-aware INSERT (for ON CONFLICT upserts)."""

from __future__ import annotations

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session


class NotFound(LookupError):
    pass


class Conflict(ValueError):
    pass


class Forbidden(PermissionError):
    """The caller may see the row but not do this to it (403)."""


def _insert(session: Session, model: type):  # type: ignore[no-untyped-def]
    dialect = session.get_bind().dialect.name
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(model)
