"""Jobs: create (idempotent), read with ownership, the list cursor, and every state change (the API's list and
views of jobs: job_views.py).

Every state change of a job goes through `transition()`: a compare-and-set UPDATE on the status (so a cancel from the
API and a finish from the worker cannot both win) plus a job_events row, in one transaction.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend import lifecycle
from backend.lifecycle import FINAL, JobStatus
from backend.persistence.crud.common import Conflict, NotFound
from backend.persistence.models import Job, JobEvent, User, utcnow
from worker.tlt.config import JobSpec


def create_job(session: Session, owner: User, spec: JobSpec, idempotency_key: str | None) -> tuple[Job, bool]:
    """Insert a queued job and its first event. With an idempotency key already used by this owner, return that job
    (created=False); the same key with a different spec is a Conflict."""
    spec_json = spec.model_dump(mode="json")
    if idempotency_key:
        existing = _by_idempotency_key(session, owner, idempotency_key)
        if existing is not None:
            return _same_spec(existing, spec_json), False
    job = Job(
        owner_id=owner.id, name=spec.name, spec=spec_json, queue=spec.queue,
        status=JobStatus.queued, idempotency_key=idempotency_key or None,
    )
    session.add(job)
    try:
        session.flush()
    except IntegrityError:  # the same key raced in from another request
        session.rollback()
        existing = _by_idempotency_key(session, owner, idempotency_key or "")
        if existing is None:
            raise
        return _same_spec(existing, spec_json), False
    session.add(JobEvent(job_id=job.id, to_status=JobStatus.queued, reason="submitted", attempt=0))
    session.commit()
    return job, True


def job_by_idempotency_key(session: Session, owner: User, key: str) -> Job | None:
    """The job `owner` already created with this Idempotency-Key, if any."""
    return _by_idempotency_key(session, owner, key)


def _by_idempotency_key(session: Session, owner: User, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.owner_id == owner.id, Job.idempotency_key == key))


def _same_spec(job: Job, spec_json: dict[str, Any]) -> Job:
    if job.spec != spec_json:
        raise Conflict(f"Idempotency-Key already used for job {job.id} with a different spec")
    return job


# The per-request reads, built once (building a select costs more CPU than SQLite spends answering it): by id, and
# by id for its owner only (a non-admin user). Executed with {"job_id": ..., "owner_id": ...}.
_JOB_BY_ID = select(Job).where(Job.id == bindparam("job_id"))
_OWN_JOB_BY_ID = _JOB_BY_ID.where(Job.owner_id == bindparam("owner_id"))
_JOB_ID_BY_ID = select(Job.id).where(Job.id == bindparam("job_id"))
_OWN_JOB_ID_BY_ID = _JOB_ID_BY_ID.where(Job.owner_id == bindparam("owner_id"))


def get_job(session: Session, user: User | None, job_id: int) -> Job:
    """The job, if `user` may see it (its owner or an admin; user None = internal caller). Else NotFound."""
    stmt = _JOB_BY_ID if user is None or user.is_admin else _OWN_JOB_BY_ID
    job = session.scalar(stmt, {"job_id": job_id, "owner_id": None if user is None else user.id})
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


def check_job_visible(session: Session, user: User, job_id: int) -> None:
    """NotFound unless the job exists and `user` may see it, as get_job, reading only the id (routes that serve a
    job's telemetry need the check, not the row and its JSON spec)."""
    stmt = _JOB_ID_BY_ID if user.is_admin else _OWN_JOB_ID_BY_ID
    if session.execute(stmt, {"job_id": job_id, "owner_id": user.id}).first() is None:
        raise NotFound(f"job {job_id} not found")


def encode_cursor(job_id: int) -> str:
    return base64.urlsafe_b64encode(f"j{job_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        value = int(raw[1:]) if raw.startswith("j") else -1
        if not 0 < value < 2**63:
            raise ValueError(raw)
        return value
    except ValueError as e:  # binascii.Error and UnicodeDecodeError are ValueErrors
        raise ValueError(f"invalid cursor {cursor!r}") from e


def transition(
    session: Session, job_id: int, to: JobStatus, *, reason: str | None = None, worker: str | None = None,
    expect: Iterable[JobStatus] | None = None, new_attempt: bool = False,
) -> Job:
    """Move a job to `to` if that is legal from its current status (and the status is in `expect`, when given).
    Compare-and-set: raises lifecycle.IllegalTransition when the status changed under us. `new_attempt` increments
    the attempt counter (a worker starting it). Commits the status change and its event together."""
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    current = JobStatus(job.status)
    if expect is not None and current not in set(expect):
        raise lifecycle.IllegalTransition(job_id, current, to)
    lifecycle.check(job_id, current, to)
    now = utcnow()
    values: dict[str, Any] = {"status": to, "updated_at": now, "reason": reason}
    if worker is not None:
        values["worker"] = worker
    if new_attempt:
        values["attempt"] = Job.attempt + 1
    if to == JobStatus.running:
        values["started_at"] = now
    if to in FINAL:
        values["finished_at"] = now
    if to == JobStatus.queued:
        values["finished_at"] = None
    res = session.execute(update(Job).where(Job.id == job_id, Job.status == current).values(**values))
    if res.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        raise lifecycle.IllegalTransition(job_id, f"{current} (changed concurrently)", to)
    session.flush()
    session.refresh(job)
    session.add(JobEvent(
        job_id=job_id, from_status=current, to_status=to, reason=reason, worker=job.worker, attempt=job.attempt,
    ))
    session.commit()
    return job


def request_cancel(session: Session, job: Job, reason: str = "cancelled by user", attempts: int = 3) -> Job:
    """queued/recovering -> cancelled, else -> cancelling. When the status moves under us (a worker took the job:
    queued -> starting -> running) re-read and try again, up to `attempts` times; a job already cancelling is
    returned as is; a final one raises IllegalTransition."""
    for attempt in range(attempts):
        status = JobStatus(job.status)
        if status == JobStatus.cancelling:
            return job
        to = JobStatus.cancelled if status in (JobStatus.queued, JobStatus.recovering) else JobStatus.cancelling
        try:
            return transition(session, job.id, to, reason=reason, expect=[status])
        except lifecycle.IllegalTransition:
            fresh = session.get(Job, job.id, populate_existing=True)
            if fresh is None:
                raise NotFound(f"job {job.id} not found") from None
            if fresh.status == status or attempt == attempts - 1:
                raise  # not a race: the transition is illegal from here (e.g. the job is final)
            job = fresh
    raise ValueError(f"attempts must be >= 1, got {attempts}")


def retry_job(session: Session, job: Job) -> Job:
    return transition(session, job.id, JobStatus.queued, reason="retry requested", expect=[JobStatus(job.status)])


def add_event(session: Session, job_id: int, reason: str, *, worker: str | None = None, attempt: int = 0) -> None:
    """An informational event (not a transition), e.g. a duplicate delivery the worker ignored."""
    status = job_status(session, job_id)
    if status is None:
        raise NotFound(f"job {job_id} not found")
    session.add(JobEvent(job_id=job_id, kind="info", from_status=status, to_status=status, reason=reason,
                         worker=worker, attempt=attempt))
    session.commit()


class Beat(NamedTuple):
    status: str  # the worker watches it for cancelling
    attempt: int  # moved past the worker's own: another worker took the job over (this one was presumed lost)


def heartbeat(session: Session, job_id: int, attempt: int | None = None) -> Beat | None:
    """Touch heartbeat_at (only while the job is still at `attempt`, when given: a superseded worker must not keep
    the new attempt looking alive); returns the job's status and attempt, None if the job is gone."""
    stmt = update(Job).where(Job.id == job_id)
    if attempt is not None:
        stmt = stmt.where(Job.attempt == attempt)
    session.execute(stmt.values(heartbeat_at=utcnow()))
    session.commit()
    row = session.execute(select(Job.status, Job.attempt).where(Job.id == job_id)).one_or_none()
    return None if row is None else Beat(row.status, row.attempt)


def job_status(session: Session, job_id: int) -> str | None:
    return session.scalar(select(Job.status).where(Job.id == job_id))


def stale_jobs(session: Session, older_than_s: float, queues: Iterable[str]) -> Sequence[Job]:
    """Jobs held by a worker whose heartbeat stopped (the worker died): candidates for recovery."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    active = [JobStatus.starting, JobStatus.running, JobStatus.recovering, JobStatus.cancelling]
    stmt = select(Job).where(Job.status.in_(active), Job.queue.in_(list(queues)))
    return [j for j in session.scalars(stmt).unique().all() if j.heartbeat_at is None or j.heartbeat_at < cutoff]


def count_jobs_by_status(session: Session, owner: User | None = None) -> dict[str, int]:
    """Jobs per status: everyone's (owner None), or only `owner`'s."""
    stmt = select(Job.status, func.count()).group_by(Job.status)
    if owner is not None:
        stmt = stmt.where(Job.owner_id == owner.id)
    rows = session.execute(stmt).all()
    return {status: int(n) for status, n in rows}
