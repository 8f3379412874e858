"""Fixtures of the hardening tests: a migrated SQLite database and the SQLAlchemy broker in a temp dir, an app built
by `create_app(settings)` per test (or per module for the fuzzer), and token helpers. SQLite keeps these fast; the
same routes run on Postgres in tests/backend.

Run: python -m pytest tests/hardening -q
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from backend.core import migrate
from backend.core.config import Settings
from backend.main import create_app
from backend.persistence import crud
from backend.persistence.db import make_engine


@dataclass
class Env:
    """An API app on its own database, with helpers."""

    settings: Settings
    engine: Engine
    client: TestClient

    def session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def token(self, user: str = "alice", admin: bool = False) -> str:
        with self.session() as s:
            return crud.create_token(s, user, admin=admin)[1]


# The worker every hardening app has registered, so admission accepts the tests' specs.
TEST_WORKER = crud.Capacity(queues=["cpu", "gpu"], gpus=8, gpu_memory_gb=80.0, host_memory_gb=64.0)


def register_test_worker(database_url: str) -> None:
    engine = make_engine(database_url)
    with Session(engine) as s:
        crud.register_worker(s, "test@host", TEST_WORKER)
    engine.dispose()


def make_settings(home: Path, **overrides: object) -> Settings:
    url = f"sqlite:///{home / 'tlt.db'}"
    home.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(url)
    fields: dict[str, object] = dict(home=home, database_url=url, broker_url=f"sqla+sqlite:///{home / 'broker.db'}",
                                     max_upload_mb=1.0, sse_poll_s=0.02, sse_max_s=0.2)
    fields.update(overrides)
    settings = Settings(**fields)  # type: ignore[arg-type]
    register_test_worker(settings.database_url)  # the database is migrated by now (an override by its caller)
    return settings


@pytest.fixture(scope="session")
def hard_settings() -> Callable[..., Settings]:
    """`hard_settings(home, **overrides) -> Settings` on a migrated SQLite database under `home` (tests cannot import
    conftest under --import-mode=importlib, so helpers come as fixtures)."""
    return make_settings


@pytest.fixture
def make_env(tmp_path: Path) -> Iterator:
    """`make_env(**settings_overrides) -> Env`; apps are closed at the end of the test."""
    opened: list[tuple[TestClient, Engine]] = []

    def make(**overrides: object) -> Env:
        settings = make_settings(tmp_path / f"home{len(opened)}", **overrides)
        client = TestClient(create_app(settings))
        client.__enter__()
        engine = make_engine(settings.database_url)
        opened.append((client, engine))
        return Env(settings, engine, client)

    yield make
    for client, engine in opened:
        client.__exit__(None, None, None)
        engine.dispose()


@pytest.fixture
def env(make_env) -> Env:  # type: ignore[no-untyped-def]
    return make_env()
