"""FastAPI dependencies: the session (`SessionDep`), the authenticated user (`CurrentUser`, `AdminUser`), settings
and the dispatcher. All come from `request.app.state`, set by `create_app(settings)`, so tests build an app per
settings object instead of patching globals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Path, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine, QueuePool
from sqlalchemy.orm import Session

from backend.core.config import Settings
from backend.core.dispatch import Dispatcher
from backend.persistence import crud
from backend.persistence.db import make_session_factory
from backend.persistence.models import User

bearer = HTTPBearer(auto_error=False, description="An API token from `tlt token create` or POST /api/v1/tokens")


def bind_sessions(app: Any, engine: Engine) -> None:
    """The app's requests get their sessions from `engine`, at most one per pooled connection at a time."""
    pool = engine.pool
    capacity = pool.size() + max(getattr(pool, "_max_overflow", 0), 0) if isinstance(pool, QueuePool) else 1
    app.state.session_factory = make_session_factory(engine)
    app.state.session_slots = asyncio.Semaphore(capacity)


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's session, closed once the endpoint's response is serialized (`scope="function"` below), made and
    closed on the event loop (making takes no connection: the first query does, in a worker thread).
    A request takes a session slot first, on the loop: there are no more slots than pooled connections, so a query
    never waits for a connection. Without them, a request holding a connection queues for a worker thread (for its
    endpoint, its response's validation) while every thread waits for a connection: at load the API stalled until
    the pool timeout (tests/backend/test_cp_api_session_dep.py reproduces it with one connection and two threads)."""
    async with request.app.state.session_slots:
        session = request.app.state.session_factory()
        try:
            yield session
        finally:
            session.close()


def _secret(creds: HTTPAuthorizationCredentials | None) -> str:
    if creds is None or creds.scheme.lower() != "bearer":
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing bearer token", {"WWW-Authenticate": "Bearer"})
    return creds.credentials


async def bearer_secret(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
    """The bearer token's secret, present or 401 (no I/O: on the loop); checked against the database later."""
    return _secret(creds)


def authenticate(session: Session, secret: str) -> User:
    user = crud.user_for_token(session, secret)
    if user is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid or revoked token", {"WWW-Authenticate": "Bearer"})
    return user


# `async def`: FastAPI runs a plain `def` dependency in a worker thread, and a request whose session already holds a
# database connection must never queue for a thread (threads waiting for a connection would deadlock the pool).
async def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_dispatcher(request: Request) -> Dispatcher:
    return request.app.state.dispatcher


MAX_ID = 2**63 - 1  # the database's bigint: larger ids and cursors are a 422, not a driver error
JobId = Annotated[int, Path(ge=1, le=MAX_ID)]
ArtifactId = Annotated[int, Path(ge=1, le=MAX_ID)]
TokenId = Annotated[int, Path(ge=1, le=MAX_ID)]
AfterId = Annotated[int, Query(ge=0, le=MAX_ID, description="only rows with a larger id (cursor)")]
AfterStep = Annotated[int | None, Query(ge=-1, le=2**31 - 1, description="only steps after this one (cursor)")]

SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
DispatcherDep = Annotated[Dispatcher, Depends(get_dispatcher)]


def get_current_user(session: SessionDep, secret: Annotated[str, Depends(bearer_secret)]) -> User:
    """The token check. Dependencies are solved before parameters are validated, so a bad token is a 401 (and an
    exhausted submit budget a 429) before a bad parameter's 422."""
    try:
        return authenticate(session, secret)
    finally:
        session.commit()  # the connection goes back to the pool before the request queues for another thread


CurrentUser = Annotated[User, Depends(get_current_user)]


def get_admin(user: CurrentUser) -> User:
    if not user.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "admin token required")
    return user


AdminUser = Annotated[User, Depends(get_admin)]


def submit_allowed(request: Request, user: CurrentUser) -> None:
    """Per-user job-submission rate limit (after authentication): 429 with Retry-After. Per user, not per token: all
    of a user's tokens draw from one bucket."""
    request.app.state.submit_limiter.check(f"user:{user.id}")


SubmitAllowed = Depends(submit_allowed)
