"""Shared test fixtures for real services: uniquely named, empty Postgres databases on 127.0.0.1:5432 (trust auth,
user postgres; dropped at the end of the session) and a Redis database number of its own (13, flushed before and
after). Nothing is created unless a test asks for the fixture. Migrate with `backend.core.migrate.upgrade(pg_url)`.

Override the servers with TLT_TEST_PG_ADMIN (an admin URL of the `postgres` database) and TLT_TEST_REDIS.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest

PG_ADMIN = os.environ.get("TLT_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TLT_TEST_REDIS", "redis://127.0.0.1:6379/13")


@pytest.fixture(scope="session")
def pg_database() -> Iterator[Callable[[], str]]:
    """A factory of fresh empty databases (SQLAlchemy URLs, psycopg 3); all dropped, even with open connections, at
    the end of the session. Use one per group of tests that must not see each other's rows."""
    import psycopg

    names: list[str] = []

    def create() -> str:
        name = f"tlt_test_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        names.append(name)
        return PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + f"/{name}"

    yield create
    with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=10) as conn:
        for name in names:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_url(pg_database: Callable[[], str]) -> str:
    """One fresh empty database for the session (not migrated: `backend.core.migrate.upgrade(pg_url)`)."""
    return pg_database()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis database used by these tests alone (flushed before and after)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=10)
    client.flushdb()
    yield REDIS_URL
    client.flushdb()
    client.close()
