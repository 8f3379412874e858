"""The worker's parts against a real database, without Celery: DbReporter (batched, idempotent on (job, step, name),
artifact digests, cooperative stop), the supervisor's claim rules (skip final, recover a lost job, leave a live one
alone), GPU assignment and the SSE parser of the client.

Run: python -m pytest tests/integration/test_cp_worker_parts.py -q   (a few seconds)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from backend.core import migrate
from backend.core.config import Settings
from backend.lifecycle import JobStatus
from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory
from backend.persistence.models import Artifact, Job, LogLine, Metric, utcnow
from worker.client import parse_sse
from worker.db_reporter import DbReporter
from worker.tasks import JobSupervisor, assign_gpus
from worker.tlt.config import JobSpec

from .conftest import TINY_SPEC


@pytest.fixture(scope="module")
def parts_pg_url(pg_database: Callable[[], str]) -> str:
    """A database of its own: the running stack's stale-job sweeper must not see these tests' jobs."""
    url = pg_database()
    migrate.upgrade(url)
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Settings, object]]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'tlt.db'}"
        migrate.upgrade(url)
    else:
        url = request.getfixturevalue("parts_pg_url")
    settings = Settings(home=tmp_path / "home", database_url=url, heartbeat_timeout_s=1.0, heartbeat_s=0.2)
    settings.ensure_dirs()
    engine = make_engine(url)
    yield settings, make_session_factory(engine)
    engine.dispose()


def _job(sessions, name: str = "parts") -> int:  # type: ignore[no-untyped-def]
    with sessions() as s:
        owner = crud.get_or_create_user(s, "parts-user")
        job, _ = crud.create_job(s, owner, JobSpec.model_validate({**TINY_SPEC, "name": name}), None)
        return job.id


def test_reporter_writes_steps_durably_and_batches_logs(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    settings, sessions = db
    job_id = _job(sessions)
    rep = DbReporter(sessions, job_id, attempt=1, artifact_root=settings.artifacts, flush_s=0.1)

    def metric_rows() -> list[tuple[int, str, float | None]]:
        with sessions() as s:
            return sorted((m.step, m.name, m.value) for m in s.scalars(select(Metric).where(Metric.job_id == job_id)))

    rep.metrics(1, {"reward/mean": 0.25, "actor/pg_loss": 1.5})
    # In the database when the call returns: a checkpoint written next can never be ahead of the metrics.
    assert metric_rows() == [(1, "actor/pg_loss", 1.5), (1, "reward/mean", 0.25)]
    rep.histogram(2, "response_length", [0.0, 4.0, 8.0], [3, 1])
    with sessions() as s:
        assert crud.list_histograms(s, job_id, "response_length", None)[0].counts == [3, 1]
    rep.log("step 2 done")
    time.sleep(0.6)  # log lines: the background flush writes them without an explicit call
    with sessions() as s:
        assert [ln.line for ln in s.scalars(select(LogLine).where(LogLine.job_id == job_id))] == ["step 2 done"]
    rep.metrics(2, {"reward/mean": 0.5})
    rep.metrics(2, {"reward/mean": 0.75})  # a replayed step (after a resume) overwrites, never duplicates
    rep.samples(2, [{"prompt": "p", "response": "r", "reward": 1.0}])
    rep.close()
    assert [r for r in metric_rows() if r[1] == "reward/mean"] == [(1, "reward/mean", 0.25), (2, "reward/mean", 0.75)]
    with pytest.raises(ValueError, match="edges"):
        rep.histogram(3, "bad", [0.0, 1.0], [1, 2])


def test_reporter_registers_artifacts_and_retention(db) -> None:  # type: ignore[no-untyped-def]
    settings, sessions = db
    job_id = _job(sessions)
    run = settings.artifacts / "jobs" / str(job_id)
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / "checkpoints" / "step-1" / "w.bin").write_bytes(b"x" * 1000)
    (run / "policy.bin").write_bytes(b"weights")
    rep = DbReporter(sessions, job_id, attempt=1, artifact_root=settings.artifacts)
    rep.artifact("policy", run / "policy.bin", step=1)
    rep.artifact("checkpoint", run / "checkpoints" / "step-1", step=1)
    (run / "checkpoints" / "step-2").mkdir()
    (run / "checkpoints" / "step-2" / "w.bin").write_bytes(b"y" * 1000)
    for f in (run / "checkpoints" / "step-1").iterdir():  # retention removed step-1 after step-2 was complete
        f.unlink()
    (run / "checkpoints" / "step-1").rmdir()
    rep.artifact("checkpoint", run / "checkpoints" / "step-2", step=2)
    with pytest.raises(ValueError, match="outside"):
        rep.artifact("policy", Path("/etc/hostname"))
    rep.close()
    with sessions() as s:
        arts = {a.path: a for a in s.scalars(select(Artifact).where(Artifact.job_id == job_id))}
    policy = arts[str(run / "policy.bin")]
    assert policy.size == 7 and policy.sha256 == hashlib.sha256(b"weights").hexdigest() and not policy.is_dir
    assert arts[str(run / "checkpoints" / "step-1")].deleted_at is not None
    assert arts[str(run / "checkpoints" / "step-2")].deleted_at is None and arts[str(run / "checkpoints" / "step-2")].is_dir


def test_reporter_should_stop_follows_cancel(db) -> None:  # type: ignore[no-untyped-def]
    settings, sessions = db
    job_id = _job(sessions)
    rep = DbReporter(sessions, job_id, attempt=1, artifact_root=settings.artifacts, stop_check_s=0.0)
    with sessions() as s:
        crud.transition(s, job_id, JobStatus.starting, worker="w", new_attempt=True)
        crud.transition(s, job_id, JobStatus.running)
    assert not rep.should_stop()
    with sessions() as s:
        crud.request_cancel(s, crud.get_job(s, None, job_id))
    assert rep.should_stop()
    rep.close()


def test_claim_rules(db) -> None:  # type: ignore[no-untyped-def]
    settings, sessions = db
    fresh, lost, done = _job(sessions, "fresh"), _job(sessions, "lost"), _job(sessions, "done")
    assert JobSupervisor(settings, fresh, "w1").claim() == (1, False)  # queued -> starting, attempt 1, no resume
    with sessions() as s:
        for jid in (lost, done):
            crud.transition(s, jid, JobStatus.starting, worker="w0", new_attempt=True)
            crud.transition(s, jid, JobStatus.running)
        crud.transition(s, done, JobStatus.succeeded)
        old = utcnow() - timedelta(seconds=60)  # w0 stopped heartbeating a minute ago
        s.execute(update(Job).where(Job.id == lost).values(heartbeat_at=old))
        s.commit()
    assert JobSupervisor(settings, done, "w1").claim() is None  # final: a duplicate delivery does nothing
    assert JobSupervisor(settings, lost, "w1").claim() == (2, True)  # lost: recovering, attempt 2, resume
    with sessions() as s:
        job = crud.get_job(s, None, lost)
        assert (job.status, job.worker) == ("recovering", "w1")
        assert "w0 lost" in crud.list_events(s, lost)[-1].reason
    t0 = time.monotonic()  # `fresh` is held by live w1 (fresh heartbeat): another delivery waits, then leaves it
    with sessions() as s:
        crud.heartbeat(s, fresh)
    sup = JobSupervisor(settings, fresh, "w2")
    sup._beat = lambda: None  # type: ignore[method-assign]
    beat_until = time.monotonic() + 2.5

    import threading

    def keep_beating() -> None:
        while time.monotonic() < beat_until:
            with sessions() as s:
                crud.heartbeat(s, fresh)
            time.sleep(0.2)

    t = threading.Thread(target=keep_beating)
    t.start()
    assert sup.claim() is None
    t.join()
    assert time.monotonic() - t0 >= 2 * settings.heartbeat_timeout_s - 0.5
    with sessions() as s:
        assert crud.get_job(s, None, fresh).status == "starting"


def test_assign_gpus() -> None:
    assert assign_gpus("0,1,2,3", 0) == ""
    assert assign_gpus("2,3", 1) == "2"
    assert assign_gpus(None, 2) == "0,1"
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        assign_gpus("0,1", 4)


def test_parse_sse() -> None:
    lines = ["retry: 1000", "", ": keep-alive", "", "event: metric", "id: 3.1.0", 'data: {"step": 1}', "",
             "event: end", "id: 3.1.0", 'data: {"status": "succeeded"}', ""]
    events = list(parse_sse(iter(lines)))
    assert [(e.event, e.id, e.data) for e in events] == [
        ("metric", "3.1.0", {"step": 1}), ("end", "3.1.0", {"status": "succeeded"})]
