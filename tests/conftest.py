"""Shared test fixtures for real services: uniquely named, empty Postgres databases on 127.0.0.1:5432 (trust auth,
user postgres; dropped at the end of the session) and Redis database numbers no other test run on this machine holds
(`redis_claims`, flushed before and after). Nothing is created unless a test asks for the fixture. Migrate with
`backend.core.migrate.upgrade(pg_url)`.

Override the servers with TLT_TEST_PG_ADMIN (an admin URL of the `postgres` database) and TLT_TEST_REDIS (a Redis
server URL; the database number is always claimed).

A run depends on nothing outside its checkout that another run could leave behind: torch C++ extensions (DeepSpeed's
ops) build in a directory of this run's own (a killed run's stale lock in the user-wide cache cannot stall it), and
every test has a timeout (pyproject: pytest-timeout, whose failure prints every thread's stack, i.e. what it waited
for). tests/isolation runs two suites at once to prove it.

Also torch on one intra-op thread for the tiny-model directories (ONE_TORCH_THREAD_DIRS), and `one_thread` for their
session fixtures. Engine test helpers live in worker/tlt/rollout/reference.py. CPU runs execute the fused Triton
kernels in Triton's interpreter (`pytest_configure`); `python -m pytest tests/kernels -m gpu` runs them compiled.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from urllib.parse import urlsplit

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """CPU runs execute the fused Triton kernels (worker/tlt/kernels) in Triton's interpreter, which must be on before
    anything imports triton (its own tl.* helpers are decorated at import; torch may import triton early), so it is
    switched on here, before any test module loads, unless this run selects the GPU tests (`-m gpu`)."""
    expr = config.getoption("markexpr") or ""
    if not ("gpu" in expr and "not gpu" not in expr):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if "TORCH_EXTENSIONS_DIR" not in os.environ:  # inherited by every child process the tests start
        os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="tlt-test-torch-ext-")
        os.environ[_OWNED_EXTENSIONS] = str(os.getpid())


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get(_OWNED_EXTENSIONS) == str(os.getpid()):
        shutil.rmtree(os.environ.pop("TORCH_EXTENSIONS_DIR"), ignore_errors=True)
        del os.environ[_OWNED_EXTENSIONS]


_OWNED_EXTENSIONS = "TLT_TEST_EXTENSIONS_OWNED"  # the pid of the run that made the directory (and removes it)


PG_ADMIN = os.environ.get("TLT_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_SERVER = urlsplit(os.environ.get("TLT_TEST_REDIS", "redis://127.0.0.1:6379"))._replace(path="").geturl()
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


class RedisClaims:
    """Redis database numbers held by this run alone. A claim is a key in database 0 (`SET NX` with a lease a daemon
    thread renews), so concurrent runs on one server take different numbers, and a killed run's numbers come free
    when its lease expires."""

    LEASE_S = 60
    NUMBERS = range(1, 16)  # a default server has 16; 0 holds the claims

    def __init__(self, server: str) -> None:
        import redis

        self.server, self.owner = server, f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.client = redis.Redis.from_url(f"{server}/0", socket_timeout=10)
        self.held: list[int] = []
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="redis-claims-lease", daemon=True)
        self._renewer.start()

    def claim(self) -> str:
        """A URL of a database no other run holds, flushed; raises when all are held."""
        for n in self.NUMBERS:
            if n not in self.held and self.client.set(self._key(n), self.owner, nx=True, ex=self.LEASE_S):
                self.held.append(n)
                url = f"{self.server}/{n}"
                self._flush(n)
                return url
        raise RuntimeError(f"every Redis database 1-15 on {self.server} is claimed by another test run (keys "
                           f"tlt-test-claim:* in database 0); wait {self.LEASE_S} s for stale claims to expire")

    def release(self) -> None:
        self._stop.set()
        self._renewer.join(timeout=5)
        for n in self.held:
            self._flush(n)
            if self.client.get(self._key(n)) == self.owner.encode():
                self.client.delete(self._key(n))
        self.held.clear()
        self.client.close()

    def _renew(self) -> None:
        while not self._stop.wait(self.LEASE_S / 4):
            for n in list(self.held):
                self.client.expire(self._key(n), self.LEASE_S)

    def _flush(self, n: int) -> None:
        import redis

        with redis.Redis.from_url(f"{self.server}/{n}", socket_timeout=10) as db:
            db.flushdb()

    @staticmethod
    def _key(n: int) -> str:
        return f"tlt-test-claim:{n}"


@pytest.fixture(scope="session")
def redis_claims() -> Iterator[RedisClaims]:
    claims = RedisClaims(REDIS_SERVER)
    yield claims
    claims.release()


@pytest.fixture(scope="session")
def redis_url(redis_claims: RedisClaims) -> str:
    """A Redis database used by this run alone (flushed when claimed and when the run ends)."""
    return redis_claims.claim()
