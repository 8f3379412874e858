"""The FastAPI application: `create_app(settings)` wires settings, database, dispatcher and routers.

    uvicorn --factory backend.main:create_app        # settings from TLT_* variables; `tlt up` does this for you

The app refuses to start when the database is not at the Alembic head (`tlt db upgrade` fixes it).
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import DataError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Scope

from backend import lifecycle
from backend.api.deps import bind_sessions
from backend.api.routes import artifacts, datasets, jobs, metric_catalog, stream, system, telemetry, tokens
from backend.core import migrate
from backend.core.config import Settings, get_settings
from backend.core.dispatch import Dispatcher
from backend.core.limits import BodyLimit, SubmitLimiter
from backend.persistence import crud
from backend.persistence.db import make_engine
from backend.schemas import errors
from backend.sse_fanout import JobStreams

log = logging.getLogger(__name__)
API_PREFIX = "/api/v1"


def _safe_json(value: Any, depth: int = 0) -> Any:
    """`value` as strict JSON can carry it: non-finite floats as their names, lone surrogates escaped, containers
    past a depth cut. A 422 echoes the client's input, which may hold exactly what JSON cannot."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if depth >= 32 and isinstance(value, dict | list | tuple):
        return "..."
    if isinstance(value, dict):
        return {_safe_json(str(k)): _safe_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_safe_json(v, depth + 1) for v in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    return _safe_json(str(value))


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _safe_json(exc.errors())}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(crud.NotFound)
    async def _not_found(_req: Request, exc: crud.NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_404_NOT_FOUND)

    @app.exception_handler(crud.Forbidden)
    async def _forbidden(_req: Request, exc: crud.Forbidden) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_403_FORBIDDEN)

    @app.exception_handler(crud.Conflict)
    async def _conflict(_req: Request, exc: crud.Conflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_409_CONFLICT)

    @app.exception_handler(lifecycle.IllegalTransition)
    async def _illegal(_req: Request, exc: lifecycle.IllegalTransition) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_409_CONFLICT)

    @app.exception_handler(PoolTimeout)
    async def _overloaded(_req: Request, exc: PoolTimeout) -> JSONResponse:
        # every database connection stayed busy for pool_timeout: overload, not a bug; clients retry
        log.warning("database pool exhausted: %s", exc)
        return JSONResponse({"detail": "server busy: no database connection free; retry shortly"},
                            status_code=status.HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": "1"})

    @app.exception_handler(DataError)
    async def _data_error(_req: Request, exc: DataError) -> JSONResponse:
        # a value the database cannot hold (e.g. an id beyond bigint): the client's input, not a server fault
        return JSONResponse({"detail": f"invalid value: {exc.orig}"}, status_code=status.HTTP_400_BAD_REQUEST)


class Dashboard(StaticFiles):
    """The built dashboard; unknown paths outside /api get index.html so client-side routes survive a reload."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        try:
            return await super().get_response(path, scope)
        except StarletteHTTPException as e:
            if e.status_code != 404 or path.startswith("api/") or scope["path"].startswith(f"{API_PREFIX}/"):
                raise
            return await super().get_response("index.html", scope)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.check_schema:
            migrate.check_current(engine)  # raises SchemaOutOfDate naming the fix
        settings.artifacts.mkdir(parents=True, exist_ok=True)
        # The start-up objects (modules, routes, schemas, mappers: ~140k) leave the collector's generations: a full
        # collection over them took ~70 ms with the GIL held, stalling every request in flight (the p99 at 200 req/s).
        gc.collect()
        gc.freeze()
        yield
        gc.unfreeze()  # collectable again once this app is gone (tests start many apps in one process)
        await app.state.job_streams.close()
        app.state.dispatcher.close()
        engine.dispose()

    app = FastAPI(
        title="TLT Studio", version="0.1.0", lifespan=lifespan,
        description="RL training of reasoning LLMs with adaptive speculative decoding. "
        "Every route except /healthz needs `Authorization: Bearer <token>` (`tlt token create`).",
    )
    app.state.settings = settings
    engine = make_engine(settings.database_url)
    bind_sessions(app, engine)
    app.state.dispatcher = Dispatcher(settings)
    app.state.job_streams = JobStreams(settings.sse_poll_s)  # SSE pollers, one per watched job, started on demand
    _error_handlers(app)
    app.state.submit_limiter = SubmitLimiter(settings.submit_rate_per_min, settings.submit_burst)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, upload_path=f"{API_PREFIX}/datasets",
                       upload_max_bytes=settings.max_upload_bytes)

    api = APIRouter(prefix=API_PREFIX, responses=errors(400, 401, 413, 422))
    for r in (jobs.router, telemetry.router, stream.router, artifacts.router, datasets.router, tokens.router,
              system.api_router, metric_catalog.router):
        api.include_router(r)
    app.include_router(api)
    app.include_router(system.health_router)

    if Path(settings.frontend_dir).is_dir():  # the built dashboard, when there is one
        app.mount("/", Dashboard(directory=settings.frontend_dir, html=True), name="dashboard")
    return app
