"""A cancel never fails just because the job is moving: crud.request_cancel re-reads and retries when a worker changes
the status under it (queued -> starting between the read and the compare-and-set), on SQLite and Postgres; a cancel
of a final job is still a 409.

Run: python -m pytest tests/hardening/test_hard_cancel_race.py -q
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from backend import lifecycle
from backend.core import migrate
from backend.lifecycle import JobStatus
from backend.main import create_app
from backend.persistence import crud
from backend.persistence.db import make_engine
from worker.tlt.config import JobSpec


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}



@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path, hard_settings) -> Iterator[tuple[str, Engine]]:  # type: ignore[no-untyped-def]
    if request.param == "postgres":
        url = request.getfixturevalue("pg_database")()  # tests/conftest.py: a fresh empty database
        migrate.upgrade(url)
    else:
        url = hard_settings(tmp_path / "home").database_url
    engine = make_engine(url)
    yield url, engine
    engine.dispose()


def _queued_job(engine: Engine) -> tuple[int, str]:
    with Session(engine, expire_on_commit=False) as s:
        _tok, secret = crud.create_token(s, "alice")
        job, _ = crud.create_job(s, crud.get_or_create_user(s, "alice"), JobSpec(), None)
        return job.id, secret


def _worker_moves(engine: Engine, job_id: int, *to: JobStatus) -> None:
    with Session(engine) as other:
        for status in to:
            crud.transition(other, job_id, status, worker="w1", new_attempt=status == JobStatus.starting)


def _move_during_cas(monkeypatch: pytest.MonkeyPatch, engine: Engine, job_id: int, *to: JobStatus) -> list[int]:
    """The worker's transition lands between request_cancel's read and its UPDATE (exactly once)."""
    real, calls = lifecycle.check, cast(list[int], [])

    def check(jid: int, current: JobStatus | str, target: JobStatus | str) -> None:
        real(jid, current, target)
        if not calls and target in (JobStatus.cancelled, JobStatus.cancelling):
            calls.append(1)
            _worker_moves(engine, job_id, *to)

    monkeypatch.setattr(lifecycle, "check", check)
    return calls


def test_cancel_retries_when_status_moved_under_cas(db: tuple[str, Engine], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _url, engine = db
    job_id, _ = _queued_job(engine)
    calls = _move_during_cas(monkeypatch, engine, job_id, JobStatus.starting)
    with Session(engine, expire_on_commit=False) as s:
        job = crud.request_cancel(s, crud.get_job(s, None, job_id))
        assert calls == [1] and job.status == JobStatus.cancelling
        events = [(e.from_status, e.to_status) for e in crud.list_events(s, job_id)]
    assert events == [(None, "queued"), ("queued", "starting"), ("starting", "cancelling")]


def test_cancel_with_a_stale_row_follows_the_job(db: tuple[str, Engine]) -> None:
    _url, engine = db
    job_id, _ = _queued_job(engine)
    with Session(engine, expire_on_commit=False) as s:
        stale = crud.get_job(s, None, job_id)  # read as queued ...
        _worker_moves(engine, job_id, JobStatus.starting, JobStatus.running)  # ... then the worker runs it
        assert crud.request_cancel(s, stale).status == JobStatus.cancelling


def test_cancel_route_during_a_move_and_final_jobs(  # type: ignore[no-untyped-def]
    db: tuple[str, Engine], tmp_path, monkeypatch, hard_settings
) -> None:
    url, engine = db
    job_id, secret = _queued_job(engine)
    settings = hard_settings(tmp_path / "api", database_url=url)
    with TestClient(create_app(settings)) as client:
        _move_during_cas(monkeypatch, engine, job_id, JobStatus.starting, JobStatus.running)
        r = client.post(f"/api/v1/jobs/{job_id}/cancel", headers=auth(secret))
        assert r.status_code == 200 and r.json()["status"] == "cancelling", r.text
        monkeypatch.undo()
        _worker_moves(engine, job_id, JobStatus.cancelled)
        r = client.post(f"/api/v1/jobs/{job_id}/cancel", headers=auth(secret))
        assert r.status_code == 409 and "cannot become" in r.json()["detail"]  # final: no retry loop hides it


def test_cancel_gives_up_after_attempts(db: tuple[str, Engine], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A job that keeps moving under every attempt: the last IllegalTransition is raised, not swallowed."""
    _url, engine = db
    job_id, _ = _queued_job(engine)
    calls = _move_during_cas(monkeypatch, engine, job_id, JobStatus.starting)
    with Session(engine, expire_on_commit=False) as s, pytest.raises(lifecycle.IllegalTransition):
        crud.request_cancel(s, crud.get_job(s, None, job_id), attempts=1)
    assert calls == [1]
    with Session(engine) as s:
        assert crud.job_status(s, job_id) == "starting"
