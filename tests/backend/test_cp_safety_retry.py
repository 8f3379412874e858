"""Retry resumes (finding 4 of the service-safety review), on SQLite and Postgres: a job queued again by a retry
(after cancel or failure) is claimed with resume=True, so its child gets --resume and the training loop continues
from the newest checkpoint; a first delivery starts fresh. tests/integration/test_cp_safety_e2e.py runs the whole
path (cancel mid-run, retry, resumed step) on a real worker.

Run: python -m pytest tests/backend/test_cp_safety_retry.py -q
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from backend.lifecycle import JobStatus as S
from backend.persistence import crud
from tests.specs import api_spec
from worker.tasks import JobSupervisor

SPEC = api_spec(name="t")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _claim(cp_backend, job_id: int) -> tuple[int, bool]:
    claim = JobSupervisor(cp_backend.settings, job_id, "w@host").claim()
    assert claim is not None
    return claim


def test_retry_after_cancel_resumes(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    jid = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    assert _claim(cp_backend, jid) == (1, False)  # first delivery: nothing to resume
    with cp_backend.session() as s:
        crud.transition(s, jid, S.running, worker="w@host")
    assert cp_client.post(f"/api/v1/jobs/{jid}/cancel", headers=h).json()["status"] == "cancelling"
    with cp_backend.session() as s:
        crud.transition(s, jid, S.cancelled, reason="stopped at a safe point")
    assert cp_client.post(f"/api/v1/jobs/{jid}/retry", headers=h).json()["status"] == "queued"
    attempt, resume = _claim(cp_backend, jid)
    assert (attempt, resume) == (2, True)
    assert "--resume" in JobSupervisor(cp_backend.settings, jid, "w@host").child_command(attempt, resume)


def test_retry_after_failure_resumes(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    jid = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    _claim(cp_backend, jid)
    with cp_backend.session() as s:
        crud.transition(s, jid, S.running)
        crud.transition(s, jid, S.failed, reason="training process killed by SIGKILL")
    cp_client.post(f"/api/v1/jobs/{jid}/retry", headers=h)
    assert _claim(cp_backend, jid) == (2, True)
