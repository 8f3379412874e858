"""What a job reported: events, metrics (history and names), histograms, logs and samples."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from backend.api.deps import AfterId, AfterStep, CurrentUser, JobId, SessionDep, SettingsDep
from backend.persistence import crud
from backend.schemas import (
    EventPublic,
    HistogramPublic,
    LogLinePublic,
    MetricHistory,
    MetricPoint,
    MetricSeries,
    SamplePublic,
    errors,
)
from backend.sse_fanout import format_cursor

router = APIRouter(prefix="/jobs/{job_id}", tags=["telemetry"], responses=errors(404))
HIST_MAX = 10_000  # largest `points` / `limit` of GET /histograms (a row is ~1 KB of JSON)


@router.get("/events", response_model=list[EventPublic])
def events(job_id: JobId, session: SessionDep, user: CurrentUser, after_id: AfterId = 0):
    """Every status transition (with worker and attempt) and informational event, oldest first."""
    crud.check_job_visible(session, user, job_id)
    return crud.list_events(session, job_id, after_id)


@router.get("/metrics", response_model=MetricHistory)
def metrics(
    job_id: JobId, session: SessionDep, user: CurrentUser,
    names: Annotated[list[str] | None, Query(description="metric names; repeat or comma-separate")] = None,
    after_step: AfterStep = None,
    points: Annotated[int | None, Query(ge=1, le=100_000, description="downsample each series to this many")] = None,
) -> MetricHistory:
    """History of each series, and `stream_cursor` to open GET /stream from without replaying these rows."""
    crud.check_job_visible(session, user, job_id)
    wanted = [n for item in names or [] for n in item.split(",") if n]
    cursor = format_cursor((crud.metrics_cursor(session, job_id), 0, 0))  # before the history: no row falls between
    hist = crud.metric_history(session, job_id, wanted or None, after_step, points)
    series = [
        MetricSeries(name=name, points=[MetricPoint(step=s, value=v) for s, v in pts], total=total)
        for name, (pts, total) in hist.items()
    ]
    last = max((s.points[-1].step for s in series if s.points), default=None)
    return MetricHistory(series=series, last_step=last, stream_cursor=cursor)


@router.get("/metrics/names", response_model=list[str])
def metric_names(job_id: JobId, session: SessionDep, user: CurrentUser) -> list[str]:
    crud.check_job_visible(session, user, job_id)
    return crud.metric_names(session, job_id)


@router.get("/histograms", response_model=list[HistogramPublic])
def histograms(
    job_id: JobId, session: SessionDep, user: CurrentUser,
    name: Annotated[str | None, Query(max_length=200)] = None, after_step: AfterStep = None,
    points: Annotated[int | None, Query(ge=1, le=HIST_MAX, description=(
        "thin each name's histograms to at most this many, evenly spread over its steps (first and last kept)"))] = None,
    limit: Annotated[int | None, Query(ge=1, le=HIST_MAX, description=(
        "only the newest this many (a window ending at the last step), after thinning"))] = None,
):
    """Whole per-step histograms (e.g. response_length), for drawing the long tail; oldest first."""
    crud.check_job_visible(session, user, job_id)
    return crud.list_histograms(session, job_id, name, after_step, points=points, limit=limit)


@router.get("/logs", response_model=list[LogLinePublic])
def logs(
    job_id: JobId, session: SessionDep, user: CurrentUser, settings: SettingsDep,
    after_id: AfterId = 0, limit: Annotated[int, Query(ge=1)] = 1000,
):
    crud.check_job_visible(session, user, job_id)
    return crud.list_logs(session, job_id, after_id, min(limit, 10 * settings.page_size_max))


@router.get("/samples", response_model=list[SamplePublic])
def samples(
    job_id: JobId, session: SessionDep, user: CurrentUser, settings: SettingsDep,
    after_step: AfterStep = None, limit: Annotated[int, Query(ge=1)] = 100,
):
    """A few (prompt, response, reward) examples per step."""
    crud.check_job_visible(session, user, job_id)
    return crud.list_samples(session, job_id, after_step, min(limit, settings.page_size_max))
