"""SSE fan-out over real HTTP (uvicorn, SQLite and Postgres): the streams of one job share one poller, a client that
disconnects leaves it at once (its mailbox is released), the poller stops with the last one, and a stream resumed
from a Last-Event-ID while others follow gets exactly the rows after it.

Run: python -m pytest tests/backend/test_cp_sse_fanout.py -q
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn

from backend.lifecycle import JobStatus
from backend.main import create_app
from backend.persistence import crud
from tests.specs import api_spec

SPEC = api_spec()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _server(settings: Any) -> Iterator[tuple[str, Any]]:
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{server.config.port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _open(base: str, job: int, h: dict[str, str]) -> tuple[httpx.Client, Iterator[str]]:
    """A stream read up to its first event's data line."""
    client = httpx.Client(base_url=base, headers=h, timeout=10)
    resp = client.send(client.build_request("GET", f"/api/v1/jobs/{job}/stream"), stream=True)
    lines = resp.iter_lines()
    while not next(lines).startswith("data:"):
        pass
    return client, lines


def test_streams_share_a_poller_and_leave_it_on_disconnect(cp_backend) -> None:  # type: ignore[no-untyped-def]
    h = {"Authorization": f"Bearer {cp_backend.token()}"}
    with _server(cp_backend.settings) as (base, app):
        job = httpx.post(f"{base}/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
        streams = app.state.job_streams
        opened = [_open(base, job, h) for _ in range(3)]
        _until(lambda: job in streams.pollers and len(streams.pollers[job].subscribers) == 3)
        poller = streams.pollers[job]
        opened.pop()[0].close()  # a client goes away: its subscription is released without waiting for news
        _until(lambda: len(poller.subscribers) == 2)
        for client, _ in opened:
            client.close()
        _until(lambda: not streams.pollers)
        assert poller.task is not None and poller.task.done()


def test_resumed_stream_among_followers_gets_exactly_what_it_missed(cp_backend) -> None:  # type: ignore[no-untyped-def]
    h = {"Authorization": f"Bearer {cp_backend.token()}"}
    with _server(cp_backend.settings) as (base, app):
        job = httpx.post(f"{base}/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
        with cp_backend.session() as s:
            crud.transition(s, job, JobStatus.starting, worker="w", new_attempt=True)
            crud.transition(s, job, JobStatus.running)
            for step in (1, 2):
                crud.upsert_metrics(s, job, [(step, "reward/mean", step / 10)])
                s.commit()
        follower, lines = _open(base, job, h)  # following from the start; the poller now exists
        first_id = None
        for line in lines:  # read up to step 1's metric: its id is where the second client resumes
            if line.startswith("id: ") and first_id is None:
                last_id = line[4:]
            if line.startswith("data: ") and json.loads(line[6:]).get("step") == 1:
                first_id = last_id
                break
        with cp_backend.session() as s:
            crud.upsert_metrics(s, job, [(3, "reward/mean", 0.3)])
            s.commit()
            crud.transition(s, job, JobStatus.succeeded)
        assert first_id is not None
        r = httpx.get(f"{base}/api/v1/jobs/{job}/stream", headers={**h, "Last-Event-ID": first_id}, timeout=10)
        got = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert [d.get("step") for d in got if "step" in d] == [2, 3]
        assert [d.get("to_status") for d in got if "to_status" in d] == ["succeeded"]
        assert got[-1] == {"status": "succeeded"}
        rest = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
        assert [d["step"] for d in rest if "step" in d] == [2, 3] and rest[-1] == {"status": "succeeded"}
        follower.close()
        _until(lambda: not app.state.job_streams.pollers)
