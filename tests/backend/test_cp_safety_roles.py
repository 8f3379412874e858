"""Roles are explicit (finding 7 of the service-safety review), on SQLite and Postgres: /metrics counts only the
caller's own jobs unless it is an admin token; a token is an admin token only when made one (`tlt token create
--user admin` without --admin is an ordinary token); an admin token for an existing non-admin user needs an explicit
promote (CLI and API), else a 409 that says so; a lesser token of an admin user cannot revoke its admin tokens, and
token listings show no character of a secret.

Run: python -m pytest tests/backend/test_cp_safety_roles.py -q
"""

from __future__ import annotations

import hashlib

import pytest
from fastapi.testclient import TestClient

from backend.lifecycle import JobStatus
from backend.persistence import crud
from tests.specs import api_spec

SPEC = api_spec(name="t")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _fingerprint(token: str) -> str:
    return "tlt_…" + hashlib.sha256(token.encode()).hexdigest()[:8]


def _jobs_metric(client: TestClient, token: str) -> dict[str, int]:
    r = client.get("/metrics", headers=auth(token))
    assert r.status_code == 200
    return {line.split('"')[1]: int(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
            if line.startswith("tlt_jobs{")}


def test_metrics_count_only_the_callers_jobs(cp_client: TestClient, cp_backend) -> None:
    alice, bob, root = cp_backend.token("alice"), cp_backend.token("bob"), cp_backend.token("root", admin=True)
    for token, n in ((alice, 2), (bob, 3)):
        for _ in range(n):
            assert cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=auth(token)).status_code == 201
    bob_job = cp_client.get("/api/v1/jobs", headers=auth(bob)).json()["items"][0]["id"]
    cp_client.post(f"/api/v1/jobs/{bob_job}/cancel", headers=auth(bob))
    assert _jobs_metric(cp_client, alice)["queued"] == 2 and _jobs_metric(cp_client, alice)["cancelled"] == 0
    assert (_jobs_metric(cp_client, bob)["queued"], _jobs_metric(cp_client, bob)["cancelled"]) == (2, 1)
    assert (_jobs_metric(cp_client, root)["queued"], _jobs_metric(cp_client, root)["cancelled"]) == (4, 1)
    assert _jobs_metric(cp_client, cp_backend.token("carol"))[JobStatus.queued.value] == 0


def test_token_for_an_admin_user_without_admin_is_not_admin(cp_client: TestClient, cp_backend,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`tlt token create --user admin` (no --admin) for the existing admin user: an ordinary token."""
    from worker import cli

    monkeypatch.setenv("TLT_DATABASE_URL", cp_backend.settings.database_url)
    monkeypatch.setenv("TLT_HOME", str(cp_backend.settings.home))
    from backend.core.config import get_settings

    get_settings.cache_clear()
    try:
        root = cp_backend.token("admin", admin=True)
        plain = cli.create_token("admin", admin=False, name="cli")
        made_admin = cli.create_token("admin", admin=True, name="cli")
    finally:
        get_settings.cache_clear()
    assert cp_client.get("/api/v1/users/me", headers=auth(plain)).json()["is_admin"] is False
    assert cp_client.get("/api/v1/users/me", headers=auth(made_admin)).json()["is_admin"] is True
    # the plain token sees only the admin user's own jobs and cannot mint admin tokens
    other = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=auth(cp_backend.token("bob"))).json()["id"]
    assert cp_client.get(f"/api/v1/jobs/{other}", headers=auth(plain)).status_code == 404
    assert cp_client.get(f"/api/v1/jobs/{other}", headers=auth(root)).status_code == 200
    r = cp_client.post("/api/v1/tokens", json={"user": "admin", "admin": True}, headers=auth(plain))
    assert r.status_code == 403
    listed = {t["prefix"]: t["admin"] for t in cp_client.get("/api/v1/tokens", headers=auth(root)).json()}
    assert listed[_fingerprint(plain)] is False and listed[_fingerprint(made_admin)] is True
    with cp_backend.session() as s:  # the user stays an admin: only the token is limited
        assert crud.get_or_create_user(s, "admin").is_admin


def test_admin_for_an_existing_non_admin_needs_promote(cp_client: TestClient, cp_backend,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`--admin` for an existing non-admin user silently stayed non-admin: now a 409 (API) / exit 4 (CLI) naming
    --promote, and with it the user becomes an admin."""
    from backend.core.config import get_settings
    from worker import cli

    cp_backend.token("dave")
    root = cp_backend.token("root", admin=True)
    r = cp_client.post("/api/v1/tokens", json={"user": "dave", "admin": True}, headers=auth(root))
    assert r.status_code == 409 and "promote" in r.json()["detail"]
    monkeypatch.setenv("TLT_DATABASE_URL", cp_backend.settings.database_url)
    monkeypatch.setenv("TLT_HOME", str(cp_backend.settings.home))
    get_settings.cache_clear()
    try:
        assert cli.main(["token", "create", "--user", "dave", "--admin"]) == cli.EXIT_API
        assert "--promote" in capsys.readouterr().err
        assert cli.main(["token", "create", "--user", "dave", "--promote"]) == 2  # --promote alone is a usage error
        with cp_backend.session() as s:
            assert not crud.get_or_create_user(s, "dave").is_admin
        assert cli.main(["token", "create", "--user", "dave", "--admin", "--promote"]) == 0
        promoted = capsys.readouterr().out.strip()
    finally:
        get_settings.cache_clear()
    assert cp_client.get("/api/v1/users/me", headers=auth(promoted)).json()["is_admin"] is True
    r = cp_client.post("/api/v1/tokens", json={"user": "erin"}, headers=auth(root))
    r = cp_client.post("/api/v1/tokens", json={"user": "erin", "admin": True, "promote": True}, headers=auth(root))
    assert r.status_code == 201 and r.json()["admin"] is True


def test_a_lesser_token_cannot_revoke_an_admin_token(cp_client: TestClient, cp_backend) -> None:
    """A non-admin token of an admin user revoked that user's admin token (200), and its listing showed the admin
    token's first 8 secret characters. Now 403, the admin token keeps working, and listings carry no secret."""
    root = cp_backend.token("admin", admin=True)
    lesser = cp_client.post("/api/v1/tokens", json={"user": "admin", "name": "ci"}, headers=auth(root)).json()
    assert lesser["admin"] is False
    mine = cp_client.get("/api/v1/tokens", headers=auth(lesser["token"])).json()
    root_id = next(t["id"] for t in mine if t["admin"])
    r = cp_client.delete(f"/api/v1/tokens/{root_id}", headers=auth(lesser["token"]))
    assert r.status_code == 403 and "only an admin token revokes it" in r.json()["detail"]
    assert cp_client.get("/api/v1/users/me", headers=auth(root)).json()["is_admin"] is True
    for secret in (root, lesser["token"]):
        listing = cp_client.get("/api/v1/tokens", headers=auth(secret)).text
        assert root[4:12] not in listing and lesser["token"][4:12] not in listing
    assert lesser["prefix"] == _fingerprint(lesser["token"])
    # the lesser token still revokes itself, and an admin token revokes the admin token
    assert cp_client.delete(f"/api/v1/tokens/{lesser['id']}", headers=auth(lesser["token"])).status_code == 200
    assert cp_client.delete(f"/api/v1/tokens/{root_id}", headers=auth(root)).status_code == 200
