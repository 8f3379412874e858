"""A failed job's reason is the error line, not a traceback with the server's install paths, on SQLite and Postgres:
the child's whole output (traceback included) is in the job's log, which only its owner and admins read.

Run: python -m pytest tests/backend/test_cp_safety_failure_reason.py -q
"""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from backend.lifecycle import JobStatus as S
from backend.persistence import crud
from tests.specs import api_spec
from worker.tasks import JobSupervisor

SPEC = api_spec()
TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/opt/tlt/.venv/lib/python3.12/site-packages/worker/runner.py", line 88, in execute',
    "    model = load_model(spec.model)",
    "ValueError: unsupported model source",
    "",
]


def test_failure_reason_is_the_error_line(cp_client: TestClient, cp_backend: Any) -> None:
    h = {"Authorization": f"Bearer {cp_backend.token()}"}
    jid = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    sup = JobSupervisor(cp_backend.settings, jid, "w@host")
    assert sup.claim() is not None
    with cp_backend.session() as s:
        crud.transition(s, jid, S.running)
        crud.add_logs(s, jid, 1, TRACEBACK, stream="output")  # what the supervisor's output pump stores
        s.commit()
    sup.tail.extend(TRACEBACK)
    sup.finish(*sup.outcome(1, killed_for_cancel=False))
    job = cp_client.get(f"/api/v1/jobs/{jid}", headers=h).json()
    assert job["status"] == "failed"
    assert job["reason"] == ("training process exited with status 1: ValueError: unsupported model source "
                             "(full output in the job's log)")
    logs = cp_client.get(f"/api/v1/jobs/{jid}/logs", headers=h).json()
    assert any("site-packages" in line["line"] for line in logs)  # the owner still has the traceback
    other = {"Authorization": f"Bearer {cp_backend.token('bob')}"}
    assert cp_client.get(f"/api/v1/jobs/{jid}/logs", headers=other).status_code == 404
