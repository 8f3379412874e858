"""A job's telemetry: metrics (idempotent upserts on (job, step, name)), histograms, events, log lines and samples,
with the history queries, downsampling and the id cursors the SSE stream resumes from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from backend.persistence.crud.common import _insert
from backend.persistence.models import Histogram, Job, JobEvent, JobSample, LogLine, Metric, utcnow

T = TypeVar("T")


STEP_TIME_METRIC = "timing_s/step"  # the metric JobProgress.last_step_time_s reports (worker/tlt/rl/trainer.py)


@dataclass(frozen=True)
class JobProgress:
    last_step: int | None = None  # the newest step with any metric; None before the first
    last_step_time_s: float | None = None  # timing_s/step of the newest step that has it; None if none / not finite


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


# Statements every read of a job runs, built once (building a select costs more CPU than SQLite spends answering it).
_EVENTS_AFTER = (select(JobEvent).where(JobEvent.job_id == bindparam("job_id"), JobEvent.id > bindparam("after_id"))
                 .order_by(JobEvent.id).limit(bindparam("limit")))
_METRICS_CURSOR = select(func.max(Metric.id)).where(Metric.job_id == bindparam("job_id"))
# A job's progress as two correlated LIMIT-1 subqueries (columns of a select from jobs), each an index probe
# (uq_metrics_job_step_name backwards; ix_metrics_job_name_step for timing_s/step), so the cost does not grow with
# the number of metric rows. The job views (crud/jobs.py) select them too.
LAST_STEP = (select(Metric.step).where(Metric.job_id == Job.id).order_by(Metric.step.desc()).limit(1)
             .scalar_subquery().label("last_step"))
LAST_STEP_TIME = (select(Metric.value).where(Metric.job_id == Job.id, Metric.name == STEP_TIME_METRIC)
                  .order_by(Metric.step.desc()).limit(1).scalar_subquery().label("last_step_time_s"))
_PROGRESS = select(Job.id, LAST_STEP, LAST_STEP_TIME).where(Job.id.in_(bindparam("job_ids", expanding=True)))


def list_events(session: Session, job_id: int, after_id: int = 0, limit: int = 1000) -> Sequence[JobEvent]:
    return session.scalars(_EVENTS_AFTER, {"job_id": job_id, "after_id": after_id, "limit": limit}).all()


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
    return session.scalar(_METRICS_CURSOR, {"job_id": job_id}) or 0


def job_progress(session: Session, job_ids: Sequence[int]) -> dict[int, JobProgress]:
    """{job id: JobProgress} for a page of jobs in ONE query (_PROGRESS: two index probes per job, whatever the
    number of metric rows). Jobs without metrics map to JobProgress()."""
    if not job_ids:
        return {}
    rows = session.execute(_PROGRESS, {"job_ids": list(job_ids)})
    return {jid: JobProgress(step, finite_or_none(t)) for jid, step, t in rows}


def stream_heads(session: Session, job_id: int) -> tuple[int, int, int]:
    """The ids of the job's newest metric, event and log line (0 where none): where an SSE poller starts reading.
    One statement of three index probes."""
    heads = [select(func.max(t.id)).where(t.job_id == job_id).scalar_subquery() for t in (Metric, JobEvent, LogLine)]
    m, e, lg = session.execute(select(*heads)).one()
    return m or 0, e or 0, lg or 0


def new_metrics(session: Session, job_id: int, after_id: int, limit: int) -> Sequence[Metric]:
    stmt = select(Metric).where(Metric.job_id == job_id, Metric.id > after_id)
    return session.scalars(stmt.order_by(Metric.id).limit(limit)).all()
