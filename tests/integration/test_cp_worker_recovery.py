"""Worker-side guarantees with real processes on Postgres + Redis: cancel stops a running job at its next safe point
(status cancelled, data written so far kept), and a worker killed with SIGKILL mid-job loses nothing: the job is
requeued, resumed from its last checkpoint by another worker, and its metrics have no gap and no duplicate.

Run: python -m pytest tests/integration/test_cp_worker_recovery.py -q
"""

from __future__ import annotations

import time

import pytest

from .conftest import TINY_SPEC, Stack

pytestmark = pytest.mark.slow


def _wait_metric_step(stack: Stack, job_id: int, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    with stack.http() as c:
        while time.monotonic() < deadline:
            hist = c.get(f"/jobs/{job_id}/metrics", params={"names": "reward/mean"}).json()
            if hist["last_step"] is not None and hist["last_step"] >= step:
                return
            job = c.get(f"/jobs/{job_id}").json()
            if job["status"] in {"succeeded", "failed", "cancelled"}:
                break
            time.sleep(0.2)
        job = c.get(f"/jobs/{job_id}").json()
    raise AssertionError(f"job {job_id} never reached step {step}: {job['status']}: {job['reason']}\n"
                         f"{stack.worker_logs()}")


def test_cancel_stops_at_a_safe_point(pg_stack: Stack) -> None:
    with pg_stack.http() as c:
        job = c.post("/jobs", json={"spec": {**TINY_SPEC, "name": "cancel-me", "max_steps": 200}}).json()
        _wait_metric_step(pg_stack, job["id"], 1)
        assert c.post(f"/jobs/{job['id']}/cancel").json()["status"] == "cancelling"
        final = pg_stack.wait_job(job["id"], timeout_s=60)
        assert final["status"] == "cancelled", final
        output = "\n".join(ln["line"] for ln in c.get(f"/jobs/{job['id']}/logs").json())
        assert "safe point" in final["reason"], f"{final}\n{output}"
        kept = c.get(f"/jobs/{job['id']}/metrics", params={"names": "reward/mean"}).json()
        assert 1 <= kept["last_step"] < 200  # what was written is kept; it did not run to the end
        statuses = [e["to_status"] for e in c.get(f"/jobs/{job['id']}/events").json() if e["to_status"]]
        assert statuses[-2:] == ["cancelling", "cancelled"]
        assert c.post(f"/jobs/{job['id']}/cancel").status_code == 409  # already final


def test_sigkilled_worker_job_resumes_elsewhere(pg_stack: Stack) -> None:
    steps = 6
    with pg_stack.http() as c:
        job = c.post("/jobs", json={"spec": {**TINY_SPEC, "name": "survivor", "max_steps": steps}}).json()
        _wait_metric_step(pg_stack, job["id"], 2)
        victim = pg_stack.workers[0]
        pg_stack.kill_worker(victim)  # SIGKILL: no cleanup, the message stays unacked, the child dies with it
        pg_stack.start_worker()
        final = pg_stack.wait_job(job["id"], timeout_s=180)
        assert final["status"] == "succeeded", f"{final}\n{pg_stack.worker_logs()}"
        assert final["attempt"] == 2 and final["worker"].startswith("w1@")
        events = [e for e in c.get(f"/jobs/{job['id']}/events").json() if e["to_status"]]
        flow = [(e["to_status"], e["attempt"]) for e in events]
        assert flow[:3] == [("queued", 0), ("starting", 1), ("running", 1)]
        assert flow[3:] == [("recovering", 2), ("running", 2), ("succeeded", 2)]
        assert "lost" in events[3]["reason"]
        hist = c.get(f"/jobs/{job['id']}/metrics", params={"names": "reward/mean"}).json()
        assert [p["step"] for p in hist["series"][0]["points"]] == list(range(1, steps + 1))  # no gap, no duplicate
        logs = " ".join(line["line"] for line in c.get(f"/jobs/{job['id']}/logs").json())
        assert "resum" in logs.lower()
