"""Request limits: `BodyLimit` (ASGI middleware: 413 for a request body over the limit, declared or streamed) and
`SubmitLimiter` (a token bucket per user for job submissions and retries: 429 with Retry-After). Keyed by user, not
by token: a user can mint tokens, and each token must not bring a bucket of its own.

The limiter lives in the API process (one bucket table per process): behind N API replicas a user gets N times the
rate. Configure with TLT_SUBMIT_RATE_PER_MIN / TLT_SUBMIT_BURST, TLT_MAX_BODY_KB and TLT_MAX_UPLOAD_MB.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from fastapi import HTTPException, status
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UPLOAD_FRAMING = 64 * 1024  # multipart boundaries and part headers allowed on top of the upload limit


class BodyLimit:
    """Refuse request bodies over `max_bytes` (`upload_max_bytes` for POSTs to `upload_path`) with 413: at once when
    Content-Length says so, else while the body streams in (the app sees an HTTPException from `receive`)."""

    def __init__(self, app: ASGIApp, max_bytes: int, upload_path: str, upload_max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.upload_path, self.upload_max_bytes = upload_path, upload_max_bytes

    def limit_for(self, scope: Scope) -> int:
        if scope["method"] == "POST" and scope["path"].rstrip("/") == self.upload_path:
            return self.upload_max_bytes + UPLOAD_FRAMING
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        msg = f"request body exceeds the limit of {limit} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            code = status.HTTP_413_CONTENT_TOO_LARGE if length.isdigit() else status.HTTP_400_BAD_REQUEST
            await JSONResponse({"detail": msg if length.isdigit() else "bad Content-Length"},
                               status_code=code)(scope, receive, send)
            return
        await self.app(scope, _counting(receive, limit, msg), send)


def _counting(receive: Receive, limit: int, msg: str) -> Receive:
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, msg)
        return message

    return wrapped


class SubmitLimiter:
    """Token bucket per key (a user id): `burst` submissions at once, refilled at `per_min` a minute.
    `check(key)` raises 429 with Retry-After (whole seconds) when the bucket is empty. per_min 0 = unlimited."""

    def __init__(self, per_min: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = per_min / 60.0, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()

    def check(self, key: str) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = self.clock()
            tokens, at = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now)
                wait = max(1, math.ceil((1.0 - tokens) / self.rate))
                raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS,
                                    f"job submission rate limit: {self.burst} at once, {self.rate * 60:g}/min; "
                                    f"retry in {wait} s", headers={"Retry-After": str(wait)})
            self._buckets[key] = (tokens - 1.0, now)
            if len(self._buckets) > 100_000:  # forget full buckets (they behave like new ones)
                self._buckets = {k: v for k, v in self._buckets.items() if v[0] < self.burst}
