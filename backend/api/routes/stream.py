"""Server-sent events per job: `metric`, `event` (status transitions) and `log` messages as they reach the database,
then `end` once the job is final. Every message carries `id: <metrics>.<events>.<logs>` (the last row id seen of
each table), so a client reconnecting with `Last-Event-ID` (or `?last_event_id=`) gets only what it missed.

    curl -N -H "Authorization: Bearer $TLT_TOKEN" http://127.0.0.1:8000/api/v1/jobs/1/stream
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Request, status
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from backend import crud
from backend.api.deps import CurrentUser, JobId, SessionDep, SettingsDep
from backend.lifecycle import FINAL
from backend.schemas import EventPublic, LogLinePublic, errors

router = APIRouter(prefix="/jobs/{job_id}", tags=["telemetry"], responses=errors(404))
BATCH = 500  # rows per table per poll


def parse_cursor(raw: str | None) -> tuple[int, int, int]:
    if not raw:
        return 0, 0, 0
    try:
        m, e, lg = (int(x) for x in raw.split("."))
        if not all(0 <= v < 2**63 for v in (m, e, lg)):
            raise ValueError(raw)
    except ValueError as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"bad Last-Event-ID {raw!r}: expected M.E.L") from exc
    return m, e, lg


def format_cursor(metrics: int, events: int, logs: int) -> str:
    """The message id / Last-Event-ID "M.E.L": the last row id seen of metrics, job_events and log_lines."""
    return f"{metrics}.{events}.{logs}"


def _fetch(
    factory: sessionmaker[Session], job_id: int, cur: list[int]
) -> tuple[list[tuple[str, str, dict]], str | None]:
    """New rows after `cur` (advanced in place) as (event name, id, payload), and the job's status. Each message's
    id is the cursor just after that row, so resuming from any message skips exactly what was delivered."""
    out: list[tuple[str, str, dict]] = []

    def ident() -> str:
        return format_cursor(*cur)

    with factory() as s:
        job_status = crud.job_status(s, job_id)  # read first: rows written before a final status are not missed
        for ev in crud.list_events(s, job_id, cur[1], BATCH):
            cur[1] = ev.id
            out.append(("event", ident(), EventPublic.model_validate(ev).model_dump(mode="json")))
        for mt in crud.new_metrics(s, job_id, cur[0], BATCH):
            cur[0] = mt.id
            out.append(("metric", ident(), {"step": mt.step, "name": mt.name, "value": crud.finite_or_none(mt.value)}))
        for lg in crud.list_logs(s, job_id, cur[2], BATCH):
            cur[2] = lg.id
            out.append(("log", ident(), LogLinePublic.model_validate(lg).model_dump(mode="json")))
        return out, job_status


@router.get("/stream", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}, "description": "an SSE stream"}})
async def stream(
    job_id: JobId, request: Request, session: SessionDep, user: CurrentUser, settings: SettingsDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    last_event_id_q: Annotated[str | None, Query(alias="last_event_id", max_length=100)] = None,
) -> StreamingResponse:
    crud.get_job(session, user, job_id)
    cursor = list(parse_cursor(last_event_id or last_event_id_q))
    factory = request.app.state.session_factory
    session.close()  # give the connection back now: a stream lives for minutes; each poll opens a short session

    async def gen() -> AsyncIterator[str]:
        quiet_since = opened = time.monotonic()
        yield "retry: 1000\n\n"
        while not await request.is_disconnected():
            batch, job_status = await run_in_threadpool(_fetch, factory, job_id, cursor)
            for name, ident, payload in batch:
                yield f"event: {name}\nid: {ident}\ndata: {json.dumps(payload)}\n\n"
            if batch:
                quiet_since = time.monotonic()
                continue  # drain a backlog before sleeping
            if job_status is None or job_status in FINAL:
                ident = format_cursor(*cursor)
                yield f"event: end\nid: {ident}\ndata: {json.dumps({'status': job_status})}\n\n"
                return
            if settings.sse_max_s and time.monotonic() - opened > settings.sse_max_s:
                return  # bounded connection: the client reconnects with Last-Event-ID and misses nothing
            if time.monotonic() - quiet_since > settings.sse_keepalive_s:
                yield ": keep-alive\n\n"
                quiet_since = time.monotonic()
            await asyncio.sleep(settings.sse_poll_s)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(gen(), media_type="text/event-stream", headers=headers)
