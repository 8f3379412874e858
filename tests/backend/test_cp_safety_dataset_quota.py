"""Quota covers everything a user stores, on SQLite and Postgres: uploaded datasets count toward TLT_USER_QUOTA_GB
(an upload past it is a 409, and a submit once datasets and artifacts fill it), and DELETE /api/v1/datasets/{id}
removes one's own dataset and its file (404 for another user's; 409 while a queued or running job names it).

Run: python -m pytest tests/backend/test_cp_safety_dataset_quota.py -q
"""

from __future__ import annotations

import json
import os
from typing import Any

from fastapi.testclient import TestClient

from backend.main import create_app
from backend.persistence import crud

GB = 1024**3
SPEC = {"model": {"builtin": "tiny-llama"}, "algorithm": {"max_completion_length": 8}}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _rows(n_bytes: int) -> bytes:
    row = json.dumps({"question": "q" * 40, "answer": "1"}).encode() + b"\n"
    return row * (n_bytes // len(row))


def test_datasets_count_toward_the_quota_and_can_be_deleted(cp_backend: Any) -> None:
    settings = cp_backend.settings.model_copy(update={"user_quota_gb": 1000 / GB})  # 1,000 bytes
    with TestClient(create_app(settings)) as c:
        h, bob = auth(cp_backend.token("alice")), auth(cp_backend.token("bob"))
        first = c.post("/api/v1/datasets", files={"file": ("a.jsonl", _rows(600))}, headers=h)
        assert first.status_code == 201
        second = c.post("/api/v1/datasets", files={"file": ("b.jsonl", _rows(600))}, headers=h)
        assert second.status_code == 409 and "storage quota exceeded" in second.json()["detail"]
        assert "TLT_USER_QUOTA_GB" in second.json()["detail"]
        assert len(os.listdir(settings.artifacts / "datasets")) == 1  # the refused upload left no file
        ds = first.json()["id"]
        assert c.delete(f"/api/v1/datasets/{ds}", headers=bob).status_code == 404  # not bob's
        job = c.post("/api/v1/jobs", json={"spec": {**SPEC, "dataset": {"dataset_id": ds}}}, headers=h).json()["id"]
        r = c.delete(f"/api/v1/datasets/{ds}", headers=h)
        assert r.status_code == 409 and f"used by job(s) {job}" in r.json()["detail"]
        assert c.post(f"/api/v1/jobs/{job}/cancel", headers=h).json()["status"] == "cancelled"
        assert c.delete(f"/api/v1/datasets/{ds}", headers=h).status_code == 204
        assert c.get(f"/api/v1/datasets/{ds}", headers=h).status_code == 404
        assert os.listdir(settings.artifacts / "datasets") == []  # the file went with the row
        assert c.post("/api/v1/datasets", files={"file": ("b.jsonl", _rows(600))}, headers=h).status_code == 201
        with cp_backend.session() as s:  # 600 bytes of dataset + 500 of artifacts fill the 1,000-byte quota
            crud.register_artifact(s, job, kind="policy", path="/store/p", is_dir=True, size=500, sha256="0" * 64,
                                   step=None)
            s.commit()
        r = c.post("/api/v1/jobs", json={"spec": {**SPEC, "dataset": {"builtin": "toy-count"}}}, headers=h)
        assert r.status_code == 409 and "your datasets 0.00 GB" in r.json()["detail"]
