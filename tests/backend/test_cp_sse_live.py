"""The SSE stream on a real uvicorn server: rows written while a client listens arrive within a second, and the
stream ends when the job reaches a final state."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import uvicorn

from backend.lifecycle import JobStatus
from backend.main import create_app
from backend.persistence import crud
from tests.specs import api_spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_live_stream_latency(cp_backend) -> None:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(cp_backend.settings), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        token = cp_backend.token()
        h = {"Authorization": f"Bearer {token}"}
        base = f"http://127.0.0.1:{port}"
        spec = api_spec()
        jid = httpx.post(f"{base}/api/v1/jobs", json={"spec": spec}, headers=h).json()["id"]
        with cp_backend.session() as s:
            crud.transition(s, jid, JobStatus.starting, worker="w", new_attempt=True)
            crud.transition(s, jid, JobStatus.running)
        sent: dict[int, float] = {}

        def writer() -> None:
            time.sleep(0.3)
            with cp_backend.session() as s:
                for step in range(1, 4):
                    sent[step] = time.monotonic()
                    crud.upsert_metrics(s, jid, [(step, "reward/mean", step / 10)])
                    s.commit()
                    time.sleep(0.2)
                crud.transition(s, jid, JobStatus.succeeded)

        threading.Thread(target=writer, daemon=True).start()
        latencies, kinds = [], []
        with httpx.stream("GET", f"{base}/api/v1/jobs/{jid}/stream", headers=h, timeout=10) as r:
            event = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                    kinds.append(event)
                elif line.startswith("data: ") and event == "metric":
                    latencies.append(time.monotonic() - sent[json.loads(line[6:])["step"]])
        assert kinds.count("metric") == 3 and kinds[-1] == "end"
        assert max(latencies) < 1.0, latencies
    finally:
        server.should_exit = True
        thread.join(timeout=5)
