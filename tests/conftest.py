"""Shared test fixtures for real services: a uniquely named, empty Postgres database on 127.0.0.1:5432 (trust auth,
user postgres; dropped at the end of the session) and a Redis database number of its own (13, flushed before and
after). Nothing is created unless a test asks for the fixture. Migrate with `backend.core.migrate.upgrade(pg_url)`.

Override the servers with TLT_TEST_PG_ADMIN (an admin URL of the `postgres` database) and TLT_TEST_REDIS.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

PG_ADMIN = os.environ.get("TLT_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TLT_TEST_REDIS", "redis://127.0.0.1:6379/13")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """SQLAlchemy URL (psycopg 3) of a fresh empty database; dropped (even with open connections) afterwards."""
    import psycopg

    name = f"tlt_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + f"/{name}"
    with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis database used by these tests alone (flushed before and after)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=10)
    client.flushdb()
    yield REDIS_URL
    client.flushdb()
    client.close()
