"""Fixtures of the API tests: a real database per backend (SQLite file, and a uniquely named Postgres database on
127.0.0.1:5432 dropped at the end), migrated once by Alembic and emptied between tests; a real broker (a Redis database
claimed for this run, or Celery's SQLAlchemy transport on SQLite) so enqueued messages can be
checked; `create_app(settings)` per test.

Run: python -m pytest tests/backend -q
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy import Engine, inspect, text
from sqlalchemy.orm import Session

from backend.core import migrate
from backend.core.config import Settings
from backend.main import create_app
from backend.persistence import crud
from backend.persistence.db import make_engine
from backend.persistence.models import Base

PG_ADMIN = os.environ.get("TLT_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
# The worker every API test has registered (tests of admission register their own instead).
TEST_WORKER = crud.Capacity(queues=["cpu", "gpu"], gpus=8, gpu_memory_gb=80.0, host_memory_gb=64.0, cuda="12.8")


@pytest.fixture(scope="session")
def cp_pg_url() -> Iterator[str]:
    name = f"tlt_test_cp_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"
    migrate.upgrade(url)
    yield url
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def cp_sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('cpdb') / 'tlt.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture(scope="session")
def cp_redis_url(redis_claims: Any) -> str:  # tests/conftest.py:RedisClaims
    """The API tests' broker: a Redis database of their own, apart from the integration tests' (flushed per test)."""
    return redis_claims.claim()


@dataclass
class Backend:
    """One database + broker the API runs on, with helpers the tests share."""

    kind: str  # sqlite | postgres
    settings: Settings
    engine: Engine

    def session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def token(self, user: str = "alice", admin: bool = False) -> str:
        with self.session() as s:
            return crud.create_token(s, user, admin=admin)[1]

    def queued_messages(self, queue: str = "cpu") -> int:
        """Messages waiting on the broker (what the API enqueued and no worker consumed)."""
        if self.kind == "postgres":
            return int(redis.Redis.from_url(self.settings.broker_url).llen(queue))
        broker = make_engine(self.settings.broker_url.removeprefix("sqla+"))
        if not inspect(broker).has_table("kombu_message"):  # created by kombu on the first publish
            return 0
        with broker.connect() as c:
            n = c.execute(text(
                "SELECT count(*) FROM kombu_message m JOIN kombu_queue q ON m.queue_id = q.id "
                "WHERE q.name = :q AND m.visible"), {"q": queue}).scalar_one()
        broker.dispose()
        return int(n)


def _empty(engine: Engine) -> None:
    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())


@pytest.fixture(params=["sqlite", "postgres"])
def cp_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "postgres":
        url, broker = request.getfixturevalue("cp_pg_url"), request.getfixturevalue("cp_redis_url")
        redis.Redis.from_url(broker).flushdb()
    else:
        url, broker = request.getfixturevalue("cp_sqlite_url"), f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    settings = Settings(home=tmp_path / "home", database_url=url, broker_url=broker, max_upload_mb=1.0,
                        sse_poll_s=0.05)
    engine = make_engine(url)
    _empty(engine)
    backend = Backend(request.param, settings, engine)
    with backend.session() as s:  # admission needs a live worker: one that could run any test's spec
        crud.register_worker(s, "test@host", TEST_WORKER)
    yield backend
    engine.dispose()


@pytest.fixture
def cp_client(cp_backend: Backend) -> Iterator[TestClient]:
    with TestClient(create_app(cp_backend.settings)) as client:
        yield client


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@contextmanager
def _serve(settings: Settings) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)


@pytest.fixture
def live_server() -> Callable[[Settings], AbstractContextManager[str]]:
    """`with live_server(settings) as base_url:` the app on a real uvicorn server in a thread (for what the
    in-process TestClient cannot show: streams read as they come, requests served while another is busy)."""
    return _serve
