"""The session dependency gives every connection back: the token check's before the endpoint runs, the endpoint's
before the response arrives (also when the endpoint answers an error); and refusals keep their order: no or bad token
401 before a bad parameter's 422, and a good token with a bad parameter still 422.

Run: python -m pytest tests/backend/test_cp_api_session_dep.py -q
"""

from __future__ import annotations

import asyncio
import time

import anyio
import httpx
from fastapi.testclient import TestClient
from sqlalchemy import event

from backend.api.deps import bind_sessions
from backend.main import create_app
from backend.persistence.db import make_engine
from tests.specs import api_spec

SPEC = api_spec(name="hop")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_every_connection_is_back_when_the_response_arrives(cp_client: TestClient, cp_backend) -> None:  # type: ignore[no-untyped-def]
    h = auth(cp_backend.token("olga"))
    job = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    engine = cp_client.app.state.session_factory.kw["bind"]  # type: ignore[attr-defined]
    checkouts: list[int] = []
    event.listen(engine, "checkout", lambda *_a: checkouts.append(1))
    # the token check commits (its connection goes back before the endpoint's thread hop), the endpoint takes one;
    # (/users/me answers from the token check alone); a cancel commits its write, then reads the job back: a third
    for method, url, n in (("GET", f"/api/v1/jobs/{job}", 2), ("GET", "/api/v1/jobs", 2),
                           ("GET", f"/api/v1/jobs/{job}/events", 2), ("GET", "/api/v1/users/me", 1),
                           ("POST", f"/api/v1/jobs/{job}/cancel", 3)):
        checkouts.clear()
        r = cp_client.request(method, url, headers=h)
        assert r.status_code == 200, (url, r.text)
        assert len(checkouts) == n, url  # no more checkouts than that (one per query would be a regression)
        assert engine.pool.checkedout() == 0, url  # and all are back in the pool
    checkouts.clear()
    assert cp_client.get(f"/api/v1/jobs/{job + 1000}", headers=h).status_code == 404  # an endpoint's error too
    assert len(checkouts) == 2 and engine.pool.checkedout() == 0


def test_a_bad_token_is_401_before_a_bad_parameter_is_422(cp_client: TestClient, cp_backend) -> None:  # type: ignore[no-untyped-def]
    good, bad = auth(cp_backend.token("pia")), auth("tlt_not_a_token")
    for headers, code in ((bad, 401), ({}, 401), (good, 422)):
        assert cp_client.get("/api/v1/jobs/0", headers=headers).status_code == code  # job ids start at 1
        assert cp_client.get("/api/v1/jobs", params={"limit": 0}, headers=headers).status_code == code
        assert cp_client.post("/api/v1/jobs", json={"spec": {"x": 1}}, headers=headers).status_code == code
    r = cp_client.get("/api/v1/jobs/0", headers=bad)
    assert r.json()["detail"] == "invalid or revoked token" and r.headers["WWW-Authenticate"] == "Bearer"


def test_requests_beyond_the_pool_and_the_threads_all_succeed(cp_backend) -> None:  # type: ignore[no-untyped-def]
    """More concurrent requests than pooled connections and worker threads: every one is answered, none waits out the
    pool timeout. A request holding a connection while it queues for a thread would deadlock here: both threads wait
    for the one connection, held by a request that waits for a thread."""
    app = create_app(cp_backend.settings)
    engine = make_engine(cp_backend.settings.database_url, pool_size=1, max_overflow=0, pool_timeout=3)
    bind_sessions(app, engine)
    h = auth(cp_backend.token("quinn"))

    async def burst() -> list[int]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = 2
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            job = (await client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h)).json()["id"]
            gets = [client.get(f"/api/v1/jobs/{job}", headers=h) for _ in range(40)]
            return [r.status_code for r in await asyncio.gather(*gets)]

    t0 = time.monotonic()
    codes = asyncio.run(burst())
    engine.dispose()
    assert codes == [200] * 40
    assert time.monotonic() - t0 < 3.0  # no request waited for the pool timeout
