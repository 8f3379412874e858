"""An open SSE stream holds no database connection between polls (found by bench/api_load.py: 200 streams exhausted
the pool of 15 and other requests failed with 500 after 30 s): the request's session is closed once the job is
authorised, and each poll uses a short session of its own. Pool exhaustion under overload is a 503, not a 500.

Run: python -m pytest tests/hardening/test_hard_sse_pool.py -q
"""

from __future__ import annotations

import time
from typing import Any

from tests.specs import api_spec

SPEC = api_spec()


def test_open_streams_hold_no_connection(make_env: Any) -> None:
    env = make_env(sse_poll_s=30.0, sse_max_s=0.0)  # the stream sleeps between polls and never ends by itself
    h = {"Authorization": f"Bearer {env.token()}"}
    job = env.client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    pool = env.client.app.state.session_factory.kw["bind"].pool
    streams = [env.client.stream("GET", f"/api/v1/jobs/{job}/stream", headers=h) for _ in range(3)]
    try:
        for cm in streams:
            lines = cm.__enter__().iter_lines()
            while not next(lines).startswith("data:"):  # the first event (queued) was delivered: now asleep
                pass
        # after its first event a stream polls once more (draining a backlog) and then sleeps: wait for that poll
        deadline = time.monotonic() + 5.0
        while pool.checkedout() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.checkedout() == 0  # three open streams, asleep between polls, no connection held
        assert env.client.get(f"/api/v1/jobs/{job}", headers=h).status_code == 200
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)


def test_pool_exhaustion_is_503_not_500(make_env: Any) -> None:
    """Overload (every connection busy for pool_timeout) answers 503 + Retry-After, and the API recovers."""
    from backend.api.deps import bind_sessions
    from backend.persistence.db import make_engine

    env = make_env()
    h = {"Authorization": f"Bearer {env.token()}"}
    engine = make_engine(env.settings.database_url, pool_size=1, max_overflow=0, pool_timeout=0.1)
    bind_sessions(env.client.app, engine)
    with engine.connect():  # hold the only connection
        r = env.client.get("/api/v1/users/me", headers=h)
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "busy" in r.json()["detail"]
    assert env.client.get("/api/v1/users/me", headers=h).status_code == 200
    engine.dispose()
