"""What a job reported: events, metrics (history and names), histograms, logs and samples."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from backend import crud
from backend.api.deps import AfterId, AfterStep, CurrentUser, JobId, SessionDep, SettingsDep
from backend.schemas import (
    EventPublic,
    HistogramPublic,
    LogLinePublic,
    MetricHistory,
    MetricPoint,
    MetricSeries,
    SamplePublic,
)

router = APIRouter(prefix="/jobs/{job_id}", tags=["telemetry"])


@router.get("/events", response_model=list[EventPublic])
def events(job_id: JobId, session: SessionDep, user: CurrentUser, after_id: AfterId = 0):
    """Every status transition (with worker and attempt) and informational event, oldest first."""
    crud.get_job(session, user, job_id)
    return crud.list_events(session, job_id, after_id)


@router.get("/metrics", response_model=MetricHistory)
def metrics(
    job_id: JobId, session: SessionDep, user: CurrentUser,
    names: Annotated[list[str] | None, Query(description="metric names; repeat or comma-separate")] = None,
    after_step: AfterStep = None,
    points: Annotated[int | None, Query(ge=1, le=100_000, description="downsample each series to this many")] = None,
) -> MetricHistory:
    crud.get_job(session, user, job_id)
    wanted = [n for item in names or [] for n in item.split(",") if n]
    hist = crud.metric_history(session, job_id, wanted or None, after_step, points)
    series = [
        MetricSeries(name=name, points=[MetricPoint(step=s, value=v) for s, v in pts], total=total)
        for name, (pts, total) in hist.items()
    ]
    last = max((s.points[-1].step for s in series if s.points), default=None)
    return MetricHistory(series=series, last_step=last)


@router.get("/metrics/names", response_model=list[str])
def metric_names(job_id: JobId, session: SessionDep, user: CurrentUser) -> list[str]:
    crud.get_job(session, user, job_id)
    return crud.metric_names(session, job_id)


@router.get("/histograms", response_model=list[HistogramPublic])
def histograms(
    job_id: JobId, session: SessionDep, user: CurrentUser,
    name: Annotated[str | None, Query(max_length=200)] = None, after_step: AfterStep = None,
):
    """Whole per-step histograms (e.g. response_length), for drawing the long tail."""
    crud.get_job(session, user, job_id)
    return crud.list_histograms(session, job_id, name, after_step)


@router.get("/logs", response_model=list[LogLinePublic])
def logs(
    job_id: JobId, session: SessionDep, user: CurrentUser, settings: SettingsDep,
    after_id: AfterId = 0, limit: Annotated[int, Query(ge=1)] = 1000,
):
    crud.get_job(session, user, job_id)
    return crud.list_logs(session, job_id, after_id, min(limit, 10 * settings.page_size_max))


@router.get("/samples", response_model=list[SamplePublic])
def samples(
    job_id: JobId, session: SessionDep, user: CurrentUser, settings: SettingsDep,
    after_step: AfterStep = None, limit: Annotated[int, Query(ge=1)] = 100,
):
    """A few (prompt, response, reward) examples per step."""
    crud.get_job(session, user, job_id)
    return crud.list_samples(session, job_id, after_step, min(limit, settings.page_size_max))
