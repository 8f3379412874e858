"""The whole service for integration tests: a real uvicorn API and real Celery worker subprocesses (threads pool,
not eager) on Postgres + Redis (`tlt up` covers SQLite + the SQLAlchemy broker), with short heartbeats so worker loss is
detected in seconds. One stack per backend per test session; workers can be killed and started by the test.

Run: python -m pytest tests/integration -q
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from backend.core import migrate
from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory
from tests.specs import api_spec
from worker import registry

FINAL = {"succeeded", "failed", "cancelled"}
# A job the training loop finishes in seconds on CPU (tiny random model, synthetic task).
TINY_SPEC = api_spec(name="tiny", algorithm={"num_generations": 2, "prompts_per_step": 2}, rollout={"speculative": "off"},
                     drafter={"kind": "none"}, max_steps=2, save_steps=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A worker or API outlives a test run that is killed (no teardown runs); then, once the run's Redis claim lapses, it
# would consume the next run's tasks from the same database number. The kernel kills them when the run's process dies.
DIE_WITH_THE_RUN = ["setpriv", "--pdeathsig", "KILL", "--"]


@dataclass
class Stack:
    kind: str
    home: Path
    env: dict[str, str]
    url: str
    token: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    api: subprocess.Popen[bytes] | None = None

    def start_worker(self) -> subprocess.Popen[bytes]:
        n = len(self.workers)
        logf = open(self.home / f"worker{n}.log", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(
            [*DIE_WITH_THE_RUN, sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker", "-Q", "cpu,gpu",
             "--pool", "threads",
             "--concurrency", "1", "-n", f"w{n}@%h", "--loglevel", "INFO", "--without-gossip", "--without-mingle"],
            env=self.env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.workers.append(p)
        self.procs.append(p)
        return p

    def start_api(self, timeout_s: float = 60) -> subprocess.Popen[bytes]:
        """uvicorn on the stack's port (again, after `kill_api`); returns once /healthz answers."""
        port = self.url.rsplit(":", 1)[1]
        with open(self.home / "api.log", "ab") as logf:
            self.api = subprocess.Popen(
                [*DIE_WITH_THE_RUN, sys.executable, "-m", "uvicorn", "backend.main:create_app", "--factory", "--port", port,
                 "--log-level", "warning"], env=self.env, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.procs.append(self.api)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.api.poll() is None:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self.api
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("API did not start:\n" + (self.home / "api.log").read_text())

    def kill_api(self) -> None:
        assert self.api is not None
        os.killpg(self.api.pid, signal.SIGKILL)
        self.api.wait(timeout=30)

    def kill_worker(self, p: subprocess.Popen[bytes]) -> None:
        os.killpg(p.pid, signal.SIGKILL)  # the worker's own process group (started with start_new_session)
        p.wait(timeout=30)

    def http(self, token: str | None = "default") -> httpx.Client:
        tok = self.token if token == "default" else token
        return httpx.Client(base_url=self.url + "/api/v1", timeout=30,
                            headers={"Authorization": f"Bearer {tok}"} if tok else {})

    def wait_job(self, job_id: int, until: set[str] = FINAL, timeout_s: float = 180) -> dict:
        """Poll until the job's status is in `until`. A failed poll (the API or its database being restarted by a
        fault-injection test) is retried until the deadline."""
        deadline = time.monotonic() + timeout_s
        job: dict = {}
        with self.http() as c:
            while time.monotonic() < deadline:
                try:
                    r = c.get(f"/jobs/{job_id}")
                    if r.status_code == 200:
                        job = r.json()
                        if job["status"] in until:
                            return job
                except httpx.TransportError:
                    pass
                time.sleep(0.3)
        raise AssertionError(f"job {job_id} not in {until} after {timeout_s} s: {job}\n{self.worker_logs()}")

    def worker_logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(self.home.glob("worker*.log")))


def _start_stack(kind: str, home: Path, database_url: str, broker_url: str) -> Stack:
    migrate.upgrade(database_url)
    env = dict(
        os.environ, TLT_HOME=str(home), TLT_DATABASE_URL=database_url, TLT_BROKER_URL=broker_url,
        TLT_HEARTBEAT_S="0.5", TLT_HEARTBEAT_TIMEOUT_S="3", TLT_CANCEL_GRACE_S="20", TLT_BROKER_VISIBILITY_TIMEOUT_S="8",
        TLT_SSE_POLL_S="0.1", OMP_NUM_THREADS="1",
        TLT_SPEC_ROOTS=str(home.parent / f"{home.name}-models"),  # where specs may name files (outside TLT_HOME)
    )
    engine = make_engine(database_url)
    with make_session_factory(engine)() as s:
        token = crud.create_token(s, "ci", admin=False)[1]
    engine.dispose()
    stack = Stack(kind, home, env, f"http://127.0.0.1:{_free_port()}", token)
    stack.start_api()
    stack.start_worker()
    registry.wait_for_worker(database_url, ttl_s=120, timeout_s=60)  # admission needs a registered worker
    return stack


def _stop_stack(stack: Stack) -> None:
    for p in stack.procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in stack.procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="session")
def pg_stack(pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = _start_stack("postgres", tmp_path_factory.mktemp("pg_stack"), pg_url, redis_url)
    yield stack
    _stop_stack(stack)
