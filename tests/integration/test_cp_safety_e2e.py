"""Service safety on the real stack (uvicorn + a Celery worker on Postgres + Redis): the worker registers what it can
run at start and admission answers from that registry; a cancelled job retried resumes from its last checkpoint
instead of starting again at step 1 (finding 4 of the service-safety review, end to end).

Run: python -m pytest tests/integration/test_cp_safety_e2e.py -q
"""

from __future__ import annotations

import time

import pytest

from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory

from .conftest import TINY_SPEC, Stack

pytestmark = pytest.mark.slow


def _last_step(stack: Stack, job_id: int) -> int:
    with stack.http() as c:
        return c.get(f"/jobs/{job_id}/metrics", params={"names": "reward/mean"}).json()["last_step"] or 0


def test_worker_registers_and_admission_reads_it(pg_stack: Stack) -> None:
    engine = make_engine(pg_stack.env["TLT_DATABASE_URL"])
    with make_session_factory(engine)() as s:
        live = {w.name: w for w in crud.live_workers(s, ttl_s=120)}
    engine.dispose()
    assert any(name.startswith("w0@") for name in live), live
    worker = next(w for name, w in live.items() if name.startswith("w0@"))
    assert sorted(worker.queues) == ["cpu", "gpu"] and worker.host_memory_gb > 0
    with pg_stack.http() as c:
        r = c.post("/jobs", json={"spec": {**TINY_SPEC, "resources": {"queue": "nobody-listens"}}})
        assert r.status_code == 422 and "no live worker consumes queue 'nobody-listens'" in r.text
        r = c.post("/jobs", json={"spec": {**TINY_SPEC, "resources": {"gpus": worker.gpus + 1}}})
        assert r.status_code == 422 and "GPU(s)" in r.text


def test_retry_after_cancel_resumes_from_the_checkpoint(pg_stack: Stack) -> None:
    with pg_stack.http() as c:
        job = c.post("/jobs", json={"spec": {**TINY_SPEC, "name": "resume-me", "max_steps": 400}}).json()
        deadline = time.monotonic() + 120
        while _last_step(pg_stack, job["id"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.post(f"/jobs/{job['id']}/cancel").json()["status"] == "cancelling"
        cancelled = pg_stack.wait_job(job["id"], timeout_s=60)
        assert cancelled["status"] == "cancelled", cancelled
        at_cancel = _last_step(pg_stack, job["id"])  # the loop checkpoints the step it stopped after
        assert 2 <= at_cancel < 400
        # finish quickly after the resume: the spec is the job's own; a short run is the retry's business
        assert c.post(f"/jobs/{job['id']}/retry").json()["status"] == "queued"
        deadline = time.monotonic() + 120
        while _last_step(pg_stack, job["id"]) < at_cancel + 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.post(f"/jobs/{job['id']}/cancel").json()["status"] == "cancelling"
        again = pg_stack.wait_job(job["id"], timeout_s=60)
        logs = [ln["line"] for ln in c.get(f"/jobs/{job['id']}/logs", params={"limit": 5000}).json()]
        assert again["attempt"] == 2, again
        assert f"resumed from checkpoint step-{at_cancel}" in logs, logs[-20:]
        hist = c.get(f"/jobs/{job['id']}/metrics", params={"names": "reward/mean"}).json()
        steps = [p["step"] for p in hist["series"][0]["points"]]
        assert steps == list(range(1, steps[-1] + 1))  # continued after at_cancel: no restart at 1, no gap
        assert steps[-1] > at_cancel
