"""Health (open), Prometheus metrics (token required; scoped to the caller's own jobs unless admin), and the
job-spec schema and presets the dashboard's new-job form is built from."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from sqlalchemy import text

from backend.api.deps import CurrentUser, SessionDep
from backend.lifecycle import JobStatus
from backend.persistence import crud
from worker.tlt.config import PRESETS, JobSpec

health_router = APIRouter(tags=["system"])
api_router = APIRouter(tags=["system"])


@health_router.get("/healthz")
def healthz(request: Request) -> dict[str, str]:
    """Open. 200 when the database answers; used by docker-compose and `tlt up`."""
    with request.app.state.session_factory() as s:
        s.execute(text("SELECT 1"))
    return {"status": "ok"}


@health_router.get("/metrics", response_class=PlainTextResponse, responses={401: {"description": "missing, invalid or revoked token",
                                                  "content": {"application/json": {}}}})
def prometheus(session: SessionDep, user: CurrentUser) -> str:
    """Prometheus text format. Needs a bearer token (configure `authorization` in the scrape config); an admin token
    counts every user's jobs, any other token only its own user's."""
    counts = crud.count_jobs_by_status(session, None if user.is_admin else user)
    lines = ["# HELP tlt_jobs Jobs by status.", "# TYPE tlt_jobs gauge"]
    lines += [f'tlt_jobs{{status="{s.value}"}} {counts.get(s.value, 0)}' for s in JobStatus]
    return "\n".join(lines) + "\n"


@api_router.get("/spec/schema")
def spec_schema(_user: CurrentUser) -> dict[str, Any]:
    """JSON schema of worker.tlt.config.JobSpec."""
    return JobSpec.model_json_schema()


@api_router.get("/spec/presets")
def spec_presets(_user: CurrentUser) -> dict[str, Any]:
    """Named presets, as complete validated specs."""
    return {name: JobSpec.model_validate(p).model_dump(mode="json") for name, p in PRESETS.items()}
