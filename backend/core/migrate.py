"""Alembic from code: `upgrade(url)` (what `tlt db upgrade` runs) and `check_current(engine)` (the API's start-up
check). The scripts live in the repository's `migrations/` directory; `alembic.ini` at the root serves the plain
`alembic` command too (`TLT_DATABASE_URL=... alembic upgrade head`)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class SchemaOutOfDate(RuntimeError):
    pass


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logging"] = False
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def check_current(engine: Engine) -> None:
    """Raise SchemaOutOfDate (naming the command that fixes it) unless the database is at the Alembic head."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise SchemaOutOfDate(
            f"database schema is at revision {current or 'none (empty database)'} but this code needs {head}: "
            f"run `tlt db upgrade` (database {engine.url.render_as_string(hide_password=True)})"
        )
