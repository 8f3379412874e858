"""A revoked token ends its open SSE streams, on SQLite and Postgres, on a real uvicorn server: a stream opened before
`DELETE /tokens/N` kept delivering (561 events over 20 s); now it ends with an `error` event within the re-check
period (TLT_SSE_AUTH_CHECK_S) while the job keeps writing, and a reconnect is a 401. Streams also end by themselves
after TLT_SSE_MAX_S, which is on by default.

Run: python -m pytest tests/backend/test_cp_sse_revoke.py -q
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from backend.core.config import Settings
from backend.lifecycle import JobStatus
from backend.persistence import crud
from tests.specs import api_spec

SPEC = api_spec()
CHECK_S = 0.3


def _running_job(cp_backend: Any, base: str, h: dict[str, str]) -> int:
    jid = httpx.post(f"{base}/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    with cp_backend.session() as s:
        crud.transition(s, jid, JobStatus.starting, worker="w", new_attempt=True)
        crud.transition(s, jid, JobStatus.running)
    return jid


def _events(r: httpx.Response) -> Iterator[tuple[str, dict, float]]:
    event = None
    for line in r.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event:
            yield event, json.loads(line[6:]), time.monotonic()


def test_revoked_token_ends_its_open_stream(cp_backend: Any, live_server: Any) -> None:
    settings = cp_backend.settings.model_copy(update={"sse_auth_check_s": CHECK_S, "sse_max_s": 0.0})
    with live_server(settings) as base:
        admin = {"Authorization": f"Bearer {cp_backend.token('root', admin=True)}"}
        created = httpx.post(f"{base}/api/v1/tokens", json={"user": "alice"}, headers=admin).json()
        h = {"Authorization": f"Bearer {created['token']}"}
        jid = _running_job(cp_backend, base, h)
        stop = threading.Event()

        def writer() -> None:  # the job keeps producing metrics the whole time
            with cp_backend.session() as s:
                step = 0
                while not stop.is_set() and step < 400:
                    step += 1
                    crud.upsert_metrics(s, jid, [(step, "reward/mean", 0.5)])
                    s.commit()
                    time.sleep(0.02)

        threading.Thread(target=writer, daemon=True).start()
        kinds: list[str] = []
        revoked_at = None
        try:
            with httpx.stream("GET", f"{base}/api/v1/jobs/{jid}/stream", headers=h, timeout=10) as r:
                for event, data, at in _events(r):
                    kinds.append(event)
                    if event == "metric" and revoked_at is None and kinds.count("metric") >= 5:
                        assert httpx.delete(f"{base}/api/v1/tokens/{created['id']}", headers=admin).status_code == 200
                        revoked_at = time.monotonic()
                    if event == "error":
                        assert data["detail"] == "the token was revoked; the stream is closed"
                        ended_after = at - (revoked_at or at)
        finally:
            stop.set()
        assert kinds[-1] == "error" and revoked_at is not None
        assert ended_after < CHECK_S + 1.0, ended_after  # within the re-check period (plus a poll)
        assert httpx.get(f"{base}/api/v1/jobs/{jid}/stream", headers=h, timeout=5).status_code == 401


def test_streams_end_by_themselves_after_the_default_maximum(cp_backend: Any, tmp_path: Any,
                                                             live_server: Any) -> None:
    assert Settings(home=tmp_path).sse_max_s > 0  # on by default (0 would mean never)
    settings = cp_backend.settings.model_copy(update={"sse_max_s": 0.5, "sse_keepalive_s": 0.1})
    with live_server(settings) as base:
        h = {"Authorization": f"Bearer {cp_backend.token()}"}
        jid = _running_job(cp_backend, base, h)
        start = time.monotonic()
        with httpx.stream("GET", f"{base}/api/v1/jobs/{jid}/stream", headers=h, timeout=10) as r:
            body = "".join(r.iter_text())
        assert 0.5 <= time.monotonic() - start < 3.0 and ": keep-alive" in body
