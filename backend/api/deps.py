"""FastAPI dependencies: the session (`SessionDep`), the authenticated user (`CurrentUser`, `AdminUser`), settings
and the dispatcher. All come from `request.app.state`, set by `create_app(settings)`, so tests build an app per
settings object instead of patching globals."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Path, Query, Request, status
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from backend import crud
from backend.core.config import Settings
from backend.core.dispatch import Dispatcher
from backend.core.security import hash_token
from backend.models import User

bearer = HTTPBearer(auto_error=False, description="An API token from `tlt token create` or POST /api/v1/tokens")


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's session. Created on the event loop (no I/O: a connection is taken at the first query, which runs
    in a worker thread) and closed there too: a request that holds a connection must never queue for a worker thread,
    or at load every thread waits for a connection held by requests that wait for a thread (at 200 req/s that
    deadlock stalled the API until the 30 s pool timeout). Closing returns the connection; on SQLite with no
    transaction open (endpoints commit their writes) that is no I/O, on Postgres one ROLLBACK round trip."""
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        session.close()


class ReleasingRoute(APIRoute):
    """The routers' route class: a plain-`def` endpoint ends its session's read transaction in its own worker thread,
    so the connection is back in the pool before FastAPI validates the response in another worker thread. A request
    must never hold a connection while it queues for a thread: at load every thread then waits for a connection held
    by requests waiting for a thread (on Postgres at 200 req/s this stalled the API until the 30 s pool timeout)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _release_after(endpoint)
        super().__init__(path, endpoint, **kwargs)


def _release_after(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(endpoint)  # FastAPI reads the signature through __wrapped__
    def run(*args: Any, **kwargs: Any) -> Any:
        result = endpoint(*args, **kwargs)
        for value in kwargs.values():
            # nothing pending (endpoints commit their writes): this only ends the transaction; loaded attributes stay
            # (expire_on_commit=False), and a lazy load while serialising takes a connection in that thread
            if isinstance(value, Session) and not (value.new or value.dirty or value.deleted):
                value.commit()
        return result

    return run


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

SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
DispatcherDep = Annotated[Dispatcher, Depends(get_dispatcher)]


def get_current_user(
    session: SessionDep, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> User:
    if creds is None or creds.scheme.lower() != "bearer":
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing bearer token", {"WWW-Authenticate": "Bearer"})
    user = crud.user_for_token(session, creds.credentials)
    session.commit()  # the connection goes back to the pool before the request queues for its endpoint's thread
    if user is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid or revoked token", {"WWW-Authenticate": "Bearer"})
    return user


CurrentUser = Annotated[User, Depends(get_current_user)]


def get_admin(user: CurrentUser) -> User:
    if not user.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "admin token required")
    return user


AdminUser = Annotated[User, Depends(get_admin)]


def submit_allowed(
    request: Request, _user: CurrentUser, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """Per-token job-submission rate limit (after authentication): 429 with Retry-After."""
    assert creds is not None  # CurrentUser already refused requests without one
    request.app.state.submit_limiter.check(hash_token(creds.credentials))


SubmitAllowed = Depends(submit_allowed)
