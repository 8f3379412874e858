"""FastAPI dependencies: the session (`SessionDep`), the authenticated user (`CurrentUser`, `AdminUser`), settings
and the dispatcher. All come from `request.app.state`, set by `create_app(settings)`, so tests build an app per
settings object instead of patching globals."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from backend import crud
from backend.core.config import Settings
from backend.core.dispatch import Dispatcher
from backend.core.security import hash_token
from backend.models import User

bearer = HTTPBearer(auto_error=False, description="An API token from `tlt token create` or POST /api/v1/tokens")


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as session:
        yield session


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
