"""Tokens (admin for others; revoked tokens stop working), /users/me, Prometheus /metrics behind a token, and the OpenAPI
document listing every route of the issue."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.specs import api_spec


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_tokens_admin_only_and_revocation(cp_client: TestClient, cp_backend) -> None:
    admin = auth(cp_backend.token("root", admin=True))
    user = auth(cp_backend.token("alice"))
    assert cp_client.post("/api/v1/tokens", json={"user": "bob"}, headers=user).status_code == 403
    own = cp_client.get("/api/v1/tokens", headers=user).json()  # a user lists only their own
    assert [t["user"] for t in own] == ["alice"]
    r = cp_client.post("/api/v1/tokens", json={"user": "bob", "name": "ci"}, headers=admin)
    assert r.status_code == 201
    created = r.json()
    assert created["user"] == "bob" and created["token"].startswith("tlt_") and created["prefix"].startswith("tlt_…")
    assert created["token"][4:12] not in created["prefix"]  # no character of the secret
    bob = auth(created["token"])
    me = cp_client.get("/api/v1/users/me", headers=bob).json()
    assert (me["name"], me["is_admin"]) == ("bob", False)
    listed = cp_client.get("/api/v1/tokens", headers=admin).json()
    assert {t["user"] for t in listed} == {"root", "alice", "bob"} and all("token" not in t for t in listed)
    with cp_backend.session() as s:  # only the hash is stored
        from sqlalchemy import select

        from backend.persistence.models import ApiToken
        assert created["token"] not in s.scalars(select(ApiToken.token_hash)).all()
    r = cp_client.delete(f"/api/v1/tokens/{created['id']}", headers=admin)
    assert r.status_code == 200 and r.json()["revoked_at"]
    assert cp_client.get("/api/v1/users/me", headers=bob).status_code == 401
    assert cp_client.delete("/api/v1/tokens/99999", headers=admin).status_code == 404
    bad = cp_client.post("/api/v1/tokens", json={"user": "has space"}, headers=admin)
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "user"]


def test_prometheus_metrics(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    spec = api_spec()
    cp_client.post("/api/v1/jobs", json={"spec": spec}, headers=h)
    assert cp_client.get("/metrics").status_code == 401
    text = cp_client.get("/metrics", headers=h).text
    assert 'tlt_jobs{status="queued"} 1' in text and 'tlt_jobs{status="failed"} 0' in text


def test_openapi_lists_every_route(cp_client: TestClient) -> None:
    doc = cp_client.get("/openapi.json").json()
    have = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    want = {
        ("POST", "/api/v1/jobs"), ("GET", "/api/v1/jobs"), ("GET", "/api/v1/jobs/{job_id}"),
        ("POST", "/api/v1/jobs/{job_id}/cancel"), ("POST", "/api/v1/jobs/{job_id}/retry"),
        ("GET", "/api/v1/jobs/{job_id}/metrics"), ("GET", "/api/v1/jobs/{job_id}/metrics/names"),
        ("GET", "/api/v1/jobs/{job_id}/histograms"), ("GET", "/api/v1/jobs/{job_id}/events"),
        ("GET", "/api/v1/jobs/{job_id}/logs"), ("GET", "/api/v1/jobs/{job_id}/samples"),
        ("GET", "/api/v1/jobs/{job_id}/stream"), ("GET", "/api/v1/jobs/{job_id}/artifacts"),
        ("GET", "/api/v1/artifacts/{artifact_id}/download"), ("POST", "/api/v1/datasets"),
        ("GET", "/api/v1/datasets"), ("GET", "/api/v1/datasets/{dataset_id}"), ("DELETE", "/api/v1/datasets/{dataset_id}"),
        ("POST", "/api/v1/tokens"),
        ("GET", "/api/v1/tokens"), ("DELETE", "/api/v1/tokens/{token_id}"), ("GET", "/api/v1/users/me"),
        ("GET", "/api/v1/spec/schema"), ("GET", "/api/v1/spec/presets"), ("GET", "/healthz"), ("GET", "/metrics"),
    }
    assert want <= have, want - have
    assert "Idempotency-Key" in {p["name"] for p in doc["paths"]["/api/v1/jobs"]["post"]["parameters"]}
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert cp_client.get("/docs").status_code == 200
