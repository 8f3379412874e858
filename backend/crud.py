"""All queries and commits of the control plane (routes, the worker and the CLI call these; none commits elsewhere).

Every state change of a job goes through `transition()`: a compare-and-set UPDATE on the status (so a cancel from the
API and a finish from the worker cannot both win) plus a job_events row, in one transaction.
"""

from __future__ import annotations

import base64
import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import Select, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend import lifecycle
from backend.core.security import hash_token, new_token
from backend.lifecycle import FINAL, JobStatus
from backend.models import (
    ApiToken,
    Artifact,
    Dataset,
    Histogram,
    Job,
    JobEvent,
    JobSample,
    LogLine,
    Metric,
    User,
    utcnow,
)
from worker.tlt.config import JobSpec


class NotFound(LookupError):
    pass


class Conflict(ValueError):
    pass


T = TypeVar("T")
STEP_TIME_METRIC = "timing_s/step"  # the metric JobProgress.last_step_time_s reports (worker/tlt/rl/trainer.py)


@dataclass(frozen=True)
class JobProgress:
    last_step: int | None = None  # the newest step with any metric; None before the first
    last_step_time_s: float | None = None  # timing_s/step of the newest step that has it; None if none / not finite


# ---------------------------------------------------------------- users and tokens


def get_or_create_user(session: Session, name: str, *, admin: bool = False) -> User:
    user = session.scalar(select(User).where(User.name == name))
    if user is None:
        user = User(name=name, is_admin=admin)
        session.add(user)
        try:
            session.flush()
        except IntegrityError:  # created concurrently
            session.rollback()
            user = session.scalars(select(User).where(User.name == name)).one()
    return user


def create_token(session: Session, user_name: str, *, admin: bool = False, name: str = "") -> tuple[ApiToken, str]:
    """A new token for `user_name` (the user is created if new, as admin when `admin`). Returns (row, secret)."""
    user = get_or_create_user(session, user_name, admin=admin)
    secret = new_token()
    token = ApiToken(user_id=user.id, name=name, token_hash=hash_token(secret), prefix=secret[:12])
    session.add(token)
    session.commit()
    session.refresh(token)
    return token, secret


def user_for_token(session: Session, secret: str) -> User | None:
    token = session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(secret)))
    if token is None or token.revoked_at is not None:
        return None
    now = utcnow()
    if token.last_used_at is None or token.last_used_at < now - timedelta(minutes=1):
        token.last_used_at = now  # throttled: not one write per request
        session.commit()
    return token.user


def list_tokens(session: Session, owner: User | None = None) -> Sequence[ApiToken]:
    """All tokens, or only `owner`'s."""
    stmt = select(ApiToken)
    if owner is not None:
        stmt = stmt.where(ApiToken.user_id == owner.id)
    return session.scalars(stmt.order_by(ApiToken.id)).all()


def revoke_token(session: Session, token_id: int, owner: User | None = None) -> ApiToken:
    """Revoke (idempotent). With `owner`, only that user's token: another's is NotFound (ids don't leak)."""
    token = session.get(ApiToken, token_id)
    if token is None or (owner is not None and token.user_id != owner.id):
        raise NotFound(f"token {token_id} not found")
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        session.commit()
    return token


# ---------------------------------------------------------------- jobs


def _visible(stmt: Select, user: User) -> Select:
    return stmt if user.is_admin else stmt.where(Job.owner_id == user.id)


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


def _by_idempotency_key(session: Session, owner: User, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.owner_id == owner.id, Job.idempotency_key == key))


def _same_spec(job: Job, spec_json: dict[str, Any]) -> Job:
    if job.spec != spec_json:
        raise Conflict(f"Idempotency-Key already used for job {job.id} with a different spec")
    return job


def get_job(session: Session, user: User | None, job_id: int) -> Job:
    """The job, if `user` may see it (its owner or an admin; user None = internal caller). Else NotFound."""
    stmt = select(Job).where(Job.id == job_id)
    job = session.scalar(_visible(stmt, user) if user is not None else stmt)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


def list_jobs(
    session: Session, user: User, *, status: str | None = None, owner: str | None = None,
    cursor: str | None = None, limit: int = 50,
) -> tuple[Sequence[Job], str | None]:
    """Newest first. `cursor` is opaque (the previous page's next_cursor)."""
    stmt = _visible(select(Job), user)
    if status:
        stmt = stmt.where(Job.status == status)
    if owner:
        stmt = stmt.join(User, Job.owner_id == User.id).where(User.name == owner)
    if cursor:
        stmt = stmt.where(Job.id < decode_cursor(cursor))
    jobs = session.scalars(stmt.order_by(Job.id.desc()).limit(limit + 1)).unique().all()
    more = len(jobs) > limit
    jobs = jobs[:limit]
    return jobs, (encode_cursor(jobs[-1].id) if more else None)


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


def heartbeat(session: Session, job_id: int) -> str | None:
    """Touch heartbeat_at; returns the job's status (the worker watches it for cancelling)."""
    session.execute(update(Job).where(Job.id == job_id).values(heartbeat_at=utcnow()))
    session.commit()
    return session.scalar(select(Job.status).where(Job.id == job_id))


def job_status(session: Session, job_id: int) -> str | None:
    return session.scalar(select(Job.status).where(Job.id == job_id))


def stale_jobs(session: Session, older_than_s: float, queues: Iterable[str]) -> Sequence[Job]:
    """Jobs held by a worker whose heartbeat stopped (the worker died): candidates for recovery."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    active = [JobStatus.starting, JobStatus.running, JobStatus.recovering, JobStatus.cancelling]
    stmt = select(Job).where(Job.status.in_(active), Job.queue.in_(list(queues)))
    return [j for j in session.scalars(stmt).unique().all() if j.heartbeat_at is None or j.heartbeat_at < cutoff]


def list_events(session: Session, job_id: int, after_id: int = 0, limit: int = 1000) -> Sequence[JobEvent]:
    stmt = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after_id)
    return session.scalars(stmt.order_by(JobEvent.id).limit(limit)).all()


def count_jobs_by_status(session: Session) -> dict[str, int]:
    rows = session.execute(select(Job.status, func.count()).group_by(Job.status)).all()
    return {status: int(n) for status, n in rows}


# ---------------------------------------------------------------- metrics, histograms, logs, samples


def _insert(session: Session, model: type):  # type: ignore[no-untyped-def]
    dialect = session.get_bind().dialect.name
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(model)


def upsert_metrics(session: Session, job_id: int, rows: Sequence[tuple[int, str, float]]) -> None:
    """(step, name, value) rows; idempotent on (job, step, name): a replayed step overwrites, never duplicates.
    Non-finite values (a diverged loss) are stored as NULL and served as null."""
    if not rows:
        return
    latest = {(s, n): v for s, n, v in rows}  # one row per key per statement (Postgres refuses duplicates)
    stmt = _insert(session, Metric).values(
        [{"job_id": job_id, "step": s, "name": n, "value": finite_or_none(float(v)), "created_at": utcnow()}
         for (s, n), v in latest.items()]
    )
    stmt = stmt.on_conflict_do_update(index_elements=["job_id", "step", "name"], set_={"value": stmt.excluded.value})
    session.execute(stmt)


def upsert_histogram(session: Session, job_id: int, step: int, name: str, edges: list[float], counts: list[int]) -> None:
    stmt = _insert(session, Histogram).values(
        job_id=job_id, step=step, name=name, edges=list(edges), counts=list(counts)
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["job_id", "step", "name"], set_={"edges": stmt.excluded.edges, "counts": stmt.excluded.counts}
    )
    session.execute(stmt)


def metric_names(session: Session, job_id: int) -> list[str]:
    stmt = select(Metric.name).where(Metric.job_id == job_id).distinct().order_by(Metric.name)
    return list(session.scalars(stmt).all())


def metric_history(
    session: Session, job_id: int, names: Sequence[str] | None, after_step: int | None, points: int | None
) -> dict[str, tuple[list[tuple[int, float | None]], int]]:
    """{name: ([(step, value)], total)} ordered by step; with `points`, each series is thinned to at most that many
    points by keeping evenly spaced ones (the first and the last always kept)."""
    stmt = select(Metric.name, Metric.step, Metric.value).where(Metric.job_id == job_id)
    if names:
        stmt = stmt.where(Metric.name.in_(list(names)))
    if after_step is not None:
        stmt = stmt.where(Metric.step > after_step)
    out: dict[str, list[tuple[int, float | None]]] = {}
    for name, step, value in session.execute(stmt.order_by(Metric.name, Metric.step)):
        out.setdefault(name, []).append((step, finite_or_none(value)))
    return {name: (downsample(series, points), len(series)) for name, series in out.items()}


def finite_or_none(value: float | None) -> float | None:
    """NaN and infinities become None (NULL in the database, null in JSON, which has no NaN)."""
    return value if value is not None and math.isfinite(value) else None


def downsample(series: list[T], points: int | None) -> list[T]:
    """At most `points` evenly spaced items of `series` (the first and the last always kept; only the last for 1)."""
    n = len(series)
    if points is None or n <= points:
        return series
    if points == 1:
        return [series[-1]]
    idx = sorted({round(i * (n - 1) / (points - 1)) for i in range(points)})
    return [series[i] for i in idx]


def list_histograms(
    session: Session, job_id: int, name: str | None, after_step: int | None, *,
    points: int | None = None, limit: int | None = None,
) -> Sequence[Histogram]:
    """Histograms after `after_step`, ordered by (step, name). `points` thins each name's histograms to at most that
    many, evenly spread over its steps (first and last kept, as `downsample`); `limit` then keeps only the newest
    `limit` rows (a window ending at the last step). Thinning reads only (id, name, step), then the kept rows."""
    cond = [Histogram.job_id == job_id]
    if name:
        cond.append(Histogram.name == name)
    if after_step is not None:
        cond.append(Histogram.step > after_step)
    order = (Histogram.step, Histogram.name)
    if points is None:
        if limit is None:
            return session.scalars(select(Histogram).where(*cond).order_by(*order)).all()
        newest = select(Histogram).where(*cond).order_by(Histogram.step.desc(), Histogram.name.desc()).limit(limit)
        return list(reversed(session.scalars(newest).all()))
    by_name: dict[str, list[tuple[int, int]]] = {}
    keys = select(Histogram.name, Histogram.step, Histogram.id).where(*cond).order_by(Histogram.name, Histogram.step)
    for hname, step, hid in session.execute(keys):
        by_name.setdefault(hname, []).append((step, hid))
    kept = sorted((step, hname, hid) for hname, rows in by_name.items() for step, hid in downsample(rows, points))
    ids = [hid for _, _, hid in (kept[-limit:] if limit is not None else kept)]
    if not ids:
        return []
    return session.scalars(select(Histogram).where(Histogram.id.in_(ids)).order_by(*order)).all()


def add_logs(session: Session, job_id: int, attempt: int, lines: Sequence[str], stream: str = "log") -> None:
    """`stream`: "log" (the training loop's reporter.log) or "output" (the child process's stdout/stderr)."""
    session.add_all(LogLine(job_id=job_id, attempt=attempt, stream=stream, line=line) for line in lines)


def list_logs(session: Session, job_id: int, after_id: int = 0, limit: int = 1000) -> Sequence[LogLine]:
    stmt = select(LogLine).where(LogLine.job_id == job_id, LogLine.id > after_id)
    return session.scalars(stmt.order_by(LogLine.id).limit(limit)).all()


def add_samples(session: Session, job_id: int, step: int, rows: list[dict]) -> None:
    session.add(JobSample(job_id=job_id, step=step, data={"rows": rows}))


def list_samples(session: Session, job_id: int, after_step: int | None, limit: int) -> Sequence[JobSample]:
    stmt = select(JobSample).where(JobSample.job_id == job_id)
    if after_step is not None:
        stmt = stmt.where(JobSample.step > after_step)
    return session.scalars(stmt.order_by(JobSample.step, JobSample.id).limit(limit)).all()


def metrics_cursor(session: Session, job_id: int) -> int:
    """The id of the job's newest metric row (0 before the first): the M of the SSE cursor M.E.L. Read it BEFORE a
    history query so that every row up to it is in that history (a row committed in between comes twice, never
    zero times). Like the stream, this assumes a job's rows commit in id order (one writer per job: the worker's
    DbReporter); an upsert that overwrites a stored step keeps its old id. One index probe (ix_metrics_job_id_id)."""
    return session.scalar(select(func.max(Metric.id)).where(Metric.job_id == job_id)) or 0


def job_progress(session: Session, job_ids: Sequence[int]) -> dict[int, JobProgress]:
    """{job id: JobProgress} for a page of jobs in ONE query: per job two correlated LIMIT-1 subqueries, each an
    index probe (uq_metrics_job_step_name backwards; ix_metrics_job_name_step for timing_s/step), so the cost does
    not grow with the number of metric rows. Jobs without metrics map to JobProgress()."""
    if not job_ids:
        return {}
    last_step = (select(Metric.step).where(Metric.job_id == Job.id)
                 .order_by(Metric.step.desc()).limit(1).scalar_subquery())
    step_time = (select(Metric.value).where(Metric.job_id == Job.id, Metric.name == STEP_TIME_METRIC)
                 .order_by(Metric.step.desc()).limit(1).scalar_subquery())
    rows = session.execute(select(Job.id, last_step, step_time).where(Job.id.in_(list(job_ids))))
    return {jid: JobProgress(step, finite_or_none(t)) for jid, step, t in rows}


def new_metrics(session: Session, job_id: int, after_id: int, limit: int) -> Sequence[Metric]:
    stmt = select(Metric).where(Metric.job_id == job_id, Metric.id > after_id)
    return session.scalars(stmt.order_by(Metric.id).limit(limit)).all()


# ---------------------------------------------------------------- artifacts and datasets


def register_artifact(
    session: Session, job_id: int, *, kind: str, path: str, is_dir: bool, size: int, sha256: str, step: int | None
) -> None:
    """Upsert on (job, path): registering the same export twice updates it (and clears deleted_at)."""
    stmt = _insert(session, Artifact).values(
        job_id=job_id, kind=kind, path=path, is_dir=is_dir, size=size, sha256=sha256, step=step, created_at=utcnow()
    )
    session.execute(stmt.on_conflict_do_update(
        index_elements=["job_id", "path"],
        set_={"size": stmt.excluded.size, "sha256": stmt.excluded.sha256, "step": stmt.excluded.step,
              "is_dir": stmt.excluded.is_dir, "kind": stmt.excluded.kind, "deleted_at": None},
    ))


def mark_artifacts_deleted(session: Session, artifact_ids: Sequence[int]) -> None:
    """Retention removed these files: the rows stay (history) with deleted_at set; downloads answer 410."""
    if artifact_ids:
        stmt = update(Artifact).where(Artifact.id.in_(list(artifact_ids)), Artifact.deleted_at.is_(None))
        session.execute(stmt.values(deleted_at=utcnow()))


def list_artifacts(session: Session, job_id: int, kind: str | None = None) -> Sequence[Artifact]:
    stmt = select(Artifact).where(Artifact.job_id == job_id)
    if kind:
        stmt = stmt.where(Artifact.kind == kind)
    return session.scalars(stmt.order_by(Artifact.id)).all()


def get_artifact(session: Session, user: User, artifact_id: int) -> Artifact:
    art = session.get(Artifact, artifact_id)
    if art is None:
        raise NotFound(f"artifact {artifact_id} not found")
    get_job(session, user, art.job_id)  # ownership
    return art


def create_dataset(session: Session, owner: User, **fields: Any) -> Dataset:
    ds = Dataset(id="ds_" + uuid.uuid4().hex[:16], owner_id=owner.id, **fields)
    session.add(ds)
    session.commit()
    return ds


def list_datasets(session: Session, user: User) -> Sequence[Dataset]:
    stmt = select(Dataset)
    if not user.is_admin:
        stmt = stmt.where(Dataset.owner_id == user.id)
    return session.scalars(stmt.order_by(Dataset.id.desc())).all()


def get_dataset(session: Session, user: User | None, dataset_id: str) -> Dataset:
    ds = session.get(Dataset, dataset_id)
    if ds is None or (user is not None and not user.is_admin and ds.owner_id != user.id):
        raise NotFound(f"dataset {dataset_id} not found")
    return ds
