"""Shared test fixtures for real services: uniquely named, empty Postgres databases on 127.0.0.1:5432 (trust auth,
user postgres; dropped at the end of the session) and a Redis database number of its own (13, flushed before and
after). Nothing is created unless a test asks for the fixture. Migrate with `backend.core.migrate.upgrade(pg_url)`.

Override the servers with TLT_TEST_PG_ADMIN (an admin URL of the `postgres` database) and TLT_TEST_REDIS.

Also torch on one intra-op thread for the tiny-model directories (ONE_TORCH_THREAD_DIRS), and `one_thread` for their
session fixtures. Engine test helpers live in worker/tlt/rollout/reference.py. CPU runs execute the fused Triton
kernels in Triton's interpreter (`pytest_configure`); `python -m pytest tests/kernels -m gpu` runs them compiled.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """CPU runs execute the fused Triton kernels (worker/tlt/kernels) in Triton's interpreter, which must be on before
    anything imports triton (its own tl.* helpers are decorated at import; torch may import triton early), so it is
    switched on here, before any test module loads, unless this run selects the GPU tests (`-m gpu`)."""
    expr = config.getoption("markexpr") or ""
    if not ("gpu" in expr and "not gpu" not in expr):
        os.environ.setdefault("TRITON_INTERPRET", "1")


PG_ADMIN = os.environ.get("TLT_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("TLT_TEST_REDIS", "redis://127.0.0.1:6379/13")
# Tiny random models on CPU: one intra-op thread beats threads fighting over a shared 2-core box. Not the other
# directories: tests/train and tests/multigpu run SmolLM2 on CPU or load real models for GPU tests (every core helps),
# and the API tests never import torch.
ONE_TORCH_THREAD_DIRS = frozenset({"engine", "spec", "adaptive", "drafter", "kernels"})


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread inside the block; the thread count is restored after."""
    import torch  # imported here: the API tests' processes never load torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _one_torch_thread_for_tiny_models(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.path.parent.name not in ONE_TORCH_THREAD_DIRS:
        yield
        return
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def one_thread() -> Callable[[], AbstractContextManager[None]]:
    """`with one_thread(): ...` for session or module fixtures that build tiny models: they are set up before the
    autouse one-thread fixture (tests cannot import conftest under --import-mode=importlib)."""
    return one_torch_thread


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
