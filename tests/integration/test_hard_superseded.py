"""A worker cut off from the database (a real network partition: a TCP proxy to Postgres that the test cuts) for
longer than heartbeat_timeout_s is presumed lost and another worker takes its job over (attempt + 1). When the
database comes back, the old supervisor's next heartbeat sees the attempt moved on: it kills its child at once and
writes no outcome. And the job child's start-up reads wait for a database that is briefly away.

Run: python -m pytest tests/integration/test_hard_superseded.py -q   (about 10 s)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from backend.core import migrate
from backend.core.config import Settings
from backend.lifecycle import JobStatus
from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory
from worker.job_child import read_spec
from worker.tasks import JobSupervisor
from worker.tlt.config import JobSpec

from .conftest import TINY_SPEC
from .services import TcpCut


class SleeperSupervisor(JobSupervisor):
    """The real supervisor with a child that only sleeps (the training is not what is tested here)."""

    def child_command(self, attempt: int, resume: bool) -> list[str]:
        return [sys.executable, "-c", "import os, time; print('child', os.getpid(), flush=True); time.sleep(120)"]


@pytest.fixture(scope="module")
def db_url(pg_database: Callable[[], str]) -> str:
    """A database of its own (no stale-job sweeper of a running stack may see these jobs)."""
    url = pg_database()
    migrate.upgrade(url)
    return url


@pytest.fixture
def proxy(db_url: str) -> Iterator[TcpCut]:
    u = make_url(db_url)
    with TcpCut((u.host or "127.0.0.1", u.port or 5432)) as p:
        yield p


def _via(url: str, proxy: TcpCut) -> str:
    return make_url(url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


def _job(sessions) -> int:  # type: ignore[no-untyped-def]
    with sessions() as s:
        owner = crud.get_or_create_user(s, "superseded")
        return crud.create_job(s, owner, JobSpec.model_validate(TINY_SPEC), None)[0].id


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_superseded_attempt_is_killed_without_an_outcome(db_url: str, proxy: TcpCut, tmp_path: Path) -> None:
    common = dict(home=tmp_path, heartbeat_s=0.2, heartbeat_timeout_s=1.0)
    old = Settings(database_url=_via(db_url, proxy), **common)  # type: ignore[arg-type]
    new = Settings(database_url=db_url, **common)  # type: ignore[arg-type]
    sessions = make_session_factory(make_engine(db_url))
    job_id = _job(sessions)
    w1 = SleeperSupervisor(old, job_id, "w1")
    result: list[str] = []
    runner = threading.Thread(target=lambda: result.append(w1.run()), daemon=True)
    runner.start()
    _until(lambda: any(line.startswith("child ") for line in w1.tail), 20, "the child never started")
    child = int(next(line for line in w1.tail if line.startswith("child ")).split()[1])
    with sessions() as s:
        assert (crud.job_status(s, job_id), crud.get_job(s, None, job_id).attempt) == (JobStatus.running, 1)

    proxy.cut()  # w1 loses the database; its heartbeats fail
    time.sleep(old.heartbeat_timeout_s + 0.5)
    assert SleeperSupervisor(new, job_id, "w2").claim() == (2, True)  # w1 presumed lost: attempt 2 takes over
    assert _alive(child) and not result  # w1 cannot know yet
    proxy.restore()

    runner.join(timeout=15)
    assert result == ["superseded"]
    _until(lambda: not _alive(child), 5, "the old attempt's child still runs")
    with sessions() as s:
        job = crud.get_job(s, None, job_id)
        events = crud.list_events(s, job_id)
    assert (job.status, job.attempt, job.worker) == (JobStatus.recovering, 2, "w2")  # no outcome of w1 over it
    assert events[-1].to_status == JobStatus.recovering and events[-1].worker == "w2"
    beat = job.heartbeat_at
    time.sleep(3 * old.heartbeat_s)
    with sessions() as s:
        assert crud.get_job(s, None, job_id).heartbeat_at == beat  # w1 no longer beats for attempt 2
    sessions.kw["bind"].dispose()


def test_child_start_up_reads_wait_for_the_database(db_url: str, proxy: TcpCut) -> None:
    sessions = make_session_factory(make_engine(db_url))
    job_id = _job(sessions)
    child_sessions = make_session_factory(make_engine(_via(db_url, proxy)))
    proxy.cut()
    threading.Timer(1.0, proxy.restore).start()  # the database comes back after a second
    t0 = time.monotonic()
    spec = read_spec(child_sessions, job_id)  # job_child.main's start-up reads
    assert spec.name == TINY_SPEC["name"]
    assert time.monotonic() - t0 >= 0.9
    for f in (sessions, child_sessions):
        f.kw["bind"].dispose()
