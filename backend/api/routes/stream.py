"""Server-sent events per job: `metric`, `event` (status transitions) and `log` messages as they reach the database,
then `end` once the job is final. A stream re-checks its token every TLT_SSE_AUTH_CHECK_S and ends with an `error`
event once the token is revoked; it ends by itself after TLT_SSE_MAX_S (the client resumes). Every message carries `id: <metrics>.<events>.<logs>` (the last row id seen of
each table), so a client reconnecting with `Last-Event-ID` (or `?last_event_id=`) gets only what it missed.
A stream first catches up from its cursor on its own, then follows the job's one shared poller (backend/sse_fanout.py).

    curl -N -H "Authorization: Bearer $TLT_TOKEN" http://127.0.0.1:8000/api/v1/jobs/1/stream
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, status
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from backend.api.deps import CurrentUser, JobId, SessionDep, SettingsDep, bearer_secret
from backend.core.config import Settings
from backend.persistence import crud
from backend.schemas import errors
from backend.sse_fanout import JobStreams, Mailbox, Subscriber, read_after

router = APIRouter(prefix="/jobs/{job_id}", tags=["telemetry"], responses=errors(404))


def parse_cursor(raw: str | None) -> list[int]:
    if not raw:
        return [0, 0, 0]
    try:
        cursor = [int(x) for x in raw.split(".")]
        if len(cursor) != 3 or not all(0 <= v < 2**63 for v in cursor):
            raise ValueError(raw)
    except ValueError as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"bad Last-Event-ID {raw!r}: expected M.E.L") from exc
    return cursor


class SseResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so a stream's `finally` (leaving the poller) runs even
    when the client disconnects while the generator waits at a `yield`."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


REVOKED = "event: error\ndata: " + json.dumps({"detail": "the token was revoked; the stream is closed"}) + "\n\n"


class TokenWatch:
    """Re-reads a stream's token at most every `every_s` (a short session of its own): a token revoked while its
    stream is open ends the stream within that time instead of feeding it for as long as the client listens."""

    def __init__(self, factory: sessionmaker[Session], secret: str, every_s: float) -> None:
        self.factory, self.secret, self.every_s = factory, secret, every_s
        self.next_at = time.monotonic() + every_s

    def wait_s(self) -> float:
        return max(self.next_at - time.monotonic(), 0.0)

    def _live(self) -> bool:
        with self.factory() as session:
            return crud.token_is_live(session, self.secret)

    async def revoked(self) -> bool:
        if time.monotonic() < self.next_at:
            return False
        self.next_at = time.monotonic() + self.every_s
        return not await run_in_threadpool(self._live)


async def catch_up(sub: Subscriber, factory: sessionmaker[Session]) -> AsyncGenerator[str, None]:
    """Read on our own from the subscriber's cursor until nothing older is left (one batch per read)."""
    while not sub.ended:
        read = await run_in_threadpool(read_after, factory, sub.job_id, tuple(sub.cursor))
        if text := sub.render(read.items()):
            yield text
        if read.drained:
            return


async def follow(
    sub: Subscriber, factory: sessionmaker[Session], streams: JobStreams, settings: Settings, watch: TokenWatch,
) -> AsyncGenerator[str, None]:
    yield "retry: 1000\n\n"
    async for text in catch_up(sub, factory):  # a resumed or late client may be far behind
        yield text
        if await watch.revoked():
            yield REVOKED
            return
    if sub.ended:
        return
    poller = streams.join(sub, factory)  # from here every row above the poller's head reaches the mailbox
    try:
        await poller.ready.wait()
        if sub.behind(poller.head):  # rows the poller read before we joined: once more on our own
            async for text in catch_up(sub, factory):
                yield text
        opened = quiet_since = time.monotonic()
        while not sub.ended and not sub.mailbox.closed:
            wait = settings.sse_keepalive_s - (time.monotonic() - quiet_since)
            if settings.sse_max_s:
                wait = min(wait, settings.sse_max_s - (time.monotonic() - opened))
            wait = min(wait, watch.wait_s())
            if text := sub.render(await sub.mailbox.get(timeout=max(wait, 0.0))):
                yield text
                quiet_since = time.monotonic()
            if await watch.revoked():
                yield REVOKED
                return
            if settings.sse_max_s and time.monotonic() - opened > settings.sse_max_s:
                return  # bounded connection: the client reconnects with Last-Event-ID and misses nothing
            if time.monotonic() - quiet_since >= settings.sse_keepalive_s:
                yield ": keep-alive\n\n"
                quiet_since = time.monotonic()
    finally:
        streams.leave(sub, poller)


@router.get("/stream", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}, "description": "an SSE stream"}})
async def stream(
    job_id: JobId, request: Request, session: SessionDep, user: CurrentUser, settings: SettingsDep,
    secret: Annotated[str, Depends(bearer_secret)],
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    last_event_id_q: Annotated[str | None, Query(alias="last_event_id", max_length=100)] = None,
) -> StreamingResponse:
    cursor = parse_cursor(last_event_id or last_event_id_q)
    # On the loop, not in a worker thread: the session already holds the connection authentication used, and a
    # request holding a connection must never queue for a thread (threads waiting for a connection would deadlock it).
    try:
        crud.check_job_visible(session, user, job_id)  # NotFound: 404
    finally:
        session.close()  # give the connection back now: a stream lives for minutes; reads use short sessions
    sub = Subscriber(job_id, cursor, Mailbox(settings.sse_queue_max))
    factory = request.app.state.session_factory
    watch = TokenWatch(factory, secret, settings.sse_auth_check_s)
    body = follow(sub, factory, request.app.state.job_streams, settings, watch)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return SseResponse(body, media_type="text/event-stream", headers=headers)
