"""Bad input is a 4xx with a message, never a 500; the backend never imports torch; NaN metrics serve as null."""

from __future__ import annotations

import math
import subprocess
import sys

from fastapi.testclient import TestClient

from backend.persistence import crud

BIG = str(2**70)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_bad_inputs_are_4xx(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token("root", admin=True))
    cases = [
        ("get", f"/api/v1/jobs/{BIG}", {}), ("get", "/api/v1/jobs/0", {}), ("get", "/api/v1/jobs/abc", {}),
        ("post", f"/api/v1/jobs/{BIG}/cancel", {}), ("get", f"/api/v1/artifacts/{BIG}/download", {}),
        ("get", "/api/v1/jobs/1/events", {"params": {"after_id": BIG}}),
        ("get", "/api/v1/jobs/1/metrics", {"params": {"after_step": BIG}}),
        ("get", "/api/v1/jobs", {"params": {"cursor": "ajEyMzQ1Njc4OTAxMjM0NTY3ODkwMTIzNDU2Nzg5"}}),
        ("get", "/api/v1/jobs", {"params": {"limit": 0}}),
        ("post", "/api/v1/jobs", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}),
        ("post", "/api/v1/jobs", {"json": {"spec": {"model": {"builtin": "gpt-9"}}}}),
        ("post", "/api/v1/jobs", {"json": {"spec": {"model": {"builtin": "tiny-llama", "gguf": "x.gguf"}}}}),
        ("post", "/api/v1/jobs", {"json": {"spec": {}, "extra": 1}}),
        ("post", "/api/v1/jobs", {"json": {"spec": {}}, "headers": {"Idempotency-Key": "k" * 300}}),
        ("post", "/api/v1/datasets", {}),
        ("delete", f"/api/v1/tokens/{BIG}", {}),
    ]
    for method, path, kw in cases:
        headers = {**h, **kw.pop("headers", {})}
        r = getattr(cp_client, method)(path, headers=headers, **kw) if method != "delete" else \
            cp_client.delete(path, headers=headers)
        assert 400 <= r.status_code < 500, (path, kw, r.status_code, r.text)
        assert r.json()["detail"], path
    r = cp_client.post("/api/v1/jobs", json={"spec": {"model": {"builtin": "tiny-llama", "gguf": "x.gguf"}}},
                       headers=h)
    assert r.json()["detail"][0]["loc"] == ["body", "spec", "model"]
    assert "exactly one of builtin, hf_dir, gguf" in r.json()["detail"][0]["msg"]


def test_nan_metric_is_served_as_null(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    jid = cp_client.post("/api/v1/jobs", json={"spec": {"model": {"builtin": "tiny-llama"}, "algorithm": {"max_completion_length": 8}}}, headers=h).json()["id"]
    with cp_backend.session() as s:
        crud.upsert_metrics(s, jid, [(1, "actor/pg_loss", math.nan), (2, "actor/pg_loss", 1.5)])
        s.commit()
    r = cp_client.get(f"/api/v1/jobs/{jid}/metrics", headers=h)
    assert r.status_code == 200
    assert [p["value"] for p in r.json()["series"][0]["points"]] == [None, 1.5]


def test_backend_does_not_import_torch() -> None:
    code = "import sys, backend.main, backend.persistence.crud; backend.main.create_app; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
