"""Alembic is the only schema author: on a fresh SQLite file and a fresh Postgres database, `upgrade head` yields
exactly the ORM models (no autogenerate diff), downgrade/upgrade round-trips, and the API refuses to start on an
out-of-date schema with a message naming `tlt db upgrade`."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from fastapi.testclient import TestClient

from backend.core import migrate
from backend.core.config import Settings
from backend.main import create_app
from backend.persistence.db import make_engine
from backend.persistence.models import Base

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
        return
    name = f"tlt_test_mig_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_migrations_match_models(fresh_url: str) -> None:
    migrate.upgrade(fresh_url)
    engine = make_engine(fresh_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
    assert migrate.current_revision(engine) == migrate.head_revision()
    migrate.check_current(engine)  # does not raise
    engine.dispose()


def test_downgrade_round_trip(fresh_url: str) -> None:
    from alembic import command

    migrate.upgrade(fresh_url)
    command.downgrade(migrate.alembic_config(fresh_url), "base")
    engine = make_engine(fresh_url)
    assert migrate.current_revision(engine) is None
    migrate.upgrade(fresh_url)
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()


def test_api_refuses_out_of_date_schema(fresh_url: str, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, database_url=fresh_url)
    with pytest.raises(migrate.SchemaOutOfDate, match="tlt db upgrade"), TestClient(create_app(settings)):
        pass
