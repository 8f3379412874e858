"""FastAPI dependencies: the session (`SessionDep`), the authenticated user (`CurrentUser`, `AdminUser`), settings
and the dispatcher. All come from `request.app.state`, set by `create_app(settings)`, so tests build an app per
settings object instead of patching globals."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Path, Query, Request, Response, params, status
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from backend.core.config import Settings
from backend.core.dispatch import Dispatcher
from backend.core.security import hash_token
from backend.persistence import crud
from backend.persistence.models import User

bearer = HTTPBearer(auto_error=False, description="An API token from `tlt token create` or POST /api/v1/tokens")


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's session. Created on the event loop (no I/O: a connection is taken at the first query, which runs
    in a worker thread). ReleasingRoute's endpoints close it in their thread; for the others (async endpoints) the
    token check commits, so closing here returns no connection: a request that holds a connection must never queue
    for a worker thread, or at load every thread waits for a connection held by requests that wait for a thread (at
    200 req/s that deadlock stalled the API until the 30 s pool timeout)."""
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        session.close()


class ReleasingRoute(APIRoute):
    """The routers' route class: a plain-`def` endpoint runs in ONE worker-thread call together with its token check
    (and the submit rate limit), on one pooled connection that is back in the pool before the thread returns. FastAPI
    alone made three thread hops (token check, endpoint, response validation) and two connection checkouts per
    request; now the endpoint is `async` to FastAPI, so the response is validated on the loop (no I/O there: the
    session is closed in the thread, a lazy load would fail loudly instead of blocking the loop).
    A request still never holds a connection while it queues for a thread: at load every thread would then wait for
    a connection held by requests waiting for a thread (on Postgres at 200 req/s this stalled the API for 30 s).
    Order of refusals is unchanged: no token 401 (on the loop), bad token 401, over the submit limit 429, then 422."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        self.defers_auth, self._after_auth = False, list[Callable[..., Any]]()
        if not inspect.iscoroutinefunction(endpoint):
            deps = list(kwargs.get("dependencies") or [])
            after_auth = [d.dependency for d in deps if isinstance(d, AfterAuth) and d.dependency]
            kwargs["dependencies"] = [d for d in deps if not isinstance(d, AfterAuth)]
            endpoint, self.defers_auth = _in_one_thread(endpoint, after_auth)
            self._after_auth = after_auth
        super().__init__(path, endpoint, **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if not self.defers_auth:
            return handler

        async def authenticated_first(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError:
                # FastAPI validated the parameters before our thread checked the token: a bad token is still a 401
                # (and an exhausted submit budget a 429), never a 422 that would answer an unauthenticated client
                if not getattr(request.state, "authenticated", False):
                    secret = _secret(await bearer(request))
                    await run_in_threadpool(_check_in_new_session, request, secret, self._after_auth)
                raise

        return authenticated_first


class AfterAuth(params.Depends):
    """A route dependency that needs the authenticated user; ReleasingRoute runs it in the endpoint's thread, right
    after the token check, as `dependency(request, user, secret)` (elsewhere FastAPI runs it as usual)."""


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


def _check_in_new_session(request: Request, secret: str, after_auth: list[Callable[..., Any]]) -> None:
    with request.app.state.session_factory() as session:
        user = authenticate(session, secret)
        for check in after_auth:
            check(request, user, secret)


def _depends_on(hint: Any, dependency: Callable[..., Any]) -> bool:
    return any(isinstance(m, params.Depends) and m.dependency is dependency for m in getattr(hint, "__metadata__", ()))


def _in_one_thread(endpoint: Callable[..., Any], after_auth: list[Callable[..., Any]]) -> tuple[Callable[..., Any], bool]:
    """`endpoint` as an async endpoint making one worker-thread call: token check (for its `CurrentUser` parameters),
    `after_auth` checks, the endpoint, then the session closed. Returns (endpoint, whether it checks a token)."""
    hints = typing.get_type_hints(endpoint, include_extras=True)
    signature = inspect.signature(endpoint)
    user_params = [n for n in signature.parameters if _depends_on(hints.get(n), get_current_user)]
    checks_token = bool(user_params or after_auth)
    own = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a) for n, a in (
        ("_one_hop_request", Request), ("_one_hop_secret", Annotated[str, Depends(bearer_secret)]),
        ("_one_hop_session", SessionDep)) if checks_token]
    parameters = [p.replace(annotation=Annotated[str, Depends(bearer_secret)] if p.name in user_params
                            else hints.get(p.name, p.annotation)) for p in signature.parameters.values()]
    parameters = sorted(parameters + own, key=lambda p: p.kind)  # keyword-only after the rest

    def call(kwargs: dict[str, Any]) -> Any:
        if not checks_token:
            return endpoint(**kwargs)  # no token, no session (/healthz)
        request, secret = kwargs.pop("_one_hop_request"), kwargs.pop("_one_hop_secret")
        session = kwargs.pop("_one_hop_session")  # the endpoint's own session too (FastAPI caches get_session)
        try:
            user = authenticate(session, secret)
            request.state.authenticated = True
            for check in after_auth:
                check(request, user, secret)
            return endpoint(**{**kwargs, **dict.fromkeys(user_params, user)})
        finally:
            session.close()  # the connection goes back to the pool in this thread (endpoints commit their writes)

    @functools.wraps(endpoint)
    async def run(**kwargs: Any) -> Any:
        return await run_in_threadpool(call, kwargs)

    del run.__wrapped__  # FastAPI must read our signature, not the endpoint's
    run.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=parameters, return_annotation=hints.get("return", signature.return_annotation))
    return run, checks_token


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


def get_current_user(session: SessionDep, secret: Annotated[str, Depends(bearer_secret)]) -> User:
    """The token check as a dependency of its own (async endpoints: uploads, streams); ReleasingRoute's endpoints do
    it in their own thread instead."""
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


def submit_allowed(request: Request, _user: CurrentUser, secret: Annotated[str, Depends(bearer_secret)]) -> None:
    """Per-token job-submission rate limit (after authentication): 429 with Retry-After."""
    request.app.state.submit_limiter.check(hash_token(secret))


SubmitAllowed = AfterAuth(submit_allowed)
