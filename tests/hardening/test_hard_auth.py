"""Auth rules, one test per rule: tokens hashed at rest; revoked tokens rejected; users see only their own jobs,
telemetry, artifacts and datasets (404 for others', so ids don't leak) unless admin; non-admins cannot create tokens
for others. (Every route but /healthz needing a token is tested over the whole OpenAPI document in
test_hard_schemathesis.py; the routes outside it that answer without a token are the ones the README names.)

Run: python -m pytest tests/hardening/test_hard_auth.py -q
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from fastapi.routing import APIRoute
from sqlalchemy import select, text

from backend.persistence import crud
from backend.persistence.models import ApiToken, Base
from tests.specs import api_spec

SPEC = api_spec()

def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}



def _dump(env: Any) -> str:
    """Every value of every table, as text."""
    out = []
    with env.engine.connect() as c:
        for table in Base.metadata.sorted_tables:
            out += [repr(tuple(row)) for row in c.execute(text(f"SELECT * FROM {table.name}"))]
    return "\n".join(out)


def test_tokens_are_hashed_at_rest(env: Any) -> None:
    admin = env.token("root", admin=True)
    r = env.client.post("/api/v1/tokens", json={"user": "bob", "name": "ci"}, headers=auth(admin))
    assert r.status_code == 201
    secret = r.json()["token"]
    dump = _dump(env)
    for s in (admin, secret):
        assert s not in dump and s[12:] not in dump  # neither the secret nor its unshown part is stored
    with env.session() as s:
        hashes = set(s.scalars(select(ApiToken.token_hash)).all())
    assert hashlib.sha256(secret.encode()).hexdigest() in hashes
    assert all("token" not in t for t in env.client.get("/api/v1/tokens", headers=auth(admin)).json())


def test_revoked_token_is_rejected_everywhere(env: Any) -> None:
    admin = env.token("root", admin=True)
    alice1, alice2 = env.token("alice"), env.token("alice")
    job = env.client.post("/api/v1/jobs", json={"spec": SPEC}, headers=auth(alice1)).json()["id"]
    with env.session() as s:
        tid = next(t.id for t in crud.list_tokens(s) if t.prefix == alice1[:12])
    assert env.client.delete(f"/api/v1/tokens/{tid}", headers=auth(admin)).status_code == 200
    for method, url in (("GET", "/api/v1/users/me"), ("GET", f"/api/v1/jobs/{job}"), ("GET", "/api/v1/jobs"),
                        ("POST", f"/api/v1/jobs/{job}/cancel"), ("GET", f"/api/v1/jobs/{job}/metrics"),
                        ("GET", "/metrics")):
        r = env.client.request(method, url, headers=auth(alice1))
        assert r.status_code == 401 and r.json()["detail"] == "invalid or revoked token", (url, r.text)
    assert env.client.get(f"/api/v1/jobs/{job}", headers=auth(alice2)).status_code == 200  # the other one still works
    # revoking twice is fine and keeps the first revocation time
    first = env.client.delete(f"/api/v1/tokens/{tid}", headers=auth(admin)).json()["revoked_at"]
    with env.session() as s:
        revoked_at = crud.revoke_token(s, tid).revoked_at
        assert revoked_at is not None and revoked_at.isoformat().startswith(first[:19])


def test_users_see_only_their_own_resources(env: Any) -> None:
    admin, alice, bob = env.token("root", admin=True), env.token("alice"), env.token("bob")
    up = env.client.post("/api/v1/datasets", files={"file": ("a.jsonl", b'{"question": "q", "answer": "a"}\n')},
                         headers=auth(alice))
    assert up.status_code == 201, up.text
    ds = up.json()["id"]
    spec = {**SPEC, "dataset": {"dataset_id": ds}}
    job = env.client.post("/api/v1/jobs", json={"spec": spec}, headers=auth(alice)).json()["id"]
    art = env.settings.artifacts / "runs" / str(job) / "policy.bin"
    art.parent.mkdir(parents=True)
    art.write_bytes(b"weights")
    with env.session() as s:
        crud.upsert_metrics(s, job, [(0, "loss", 1.0)])
        crud.register_artifact(s, job, kind="policy", path=str(art), is_dir=False, size=7,
                               sha256=hashlib.sha256(b"weights").hexdigest(), step=None)
        s.commit()
        art_id = crud.list_artifacts(s, job)[0].id
    own = [f"/api/v1/jobs/{job}", f"/api/v1/jobs/{job}/metrics", f"/api/v1/jobs/{job}/metrics/names",
           f"/api/v1/jobs/{job}/events", f"/api/v1/jobs/{job}/logs", f"/api/v1/jobs/{job}/samples",
           f"/api/v1/jobs/{job}/histograms", f"/api/v1/jobs/{job}/artifacts", f"/api/v1/jobs/{job}/stream",
           f"/api/v1/artifacts/{art_id}/download", f"/api/v1/datasets/{ds}"]
    for url in own:
        assert env.client.get(url, headers=auth(alice)).status_code == 200, url
        assert env.client.get(url, headers=auth(admin)).status_code == 200, url
        theirs = env.client.get(url, headers=auth(bob))
        missing = env.client.get(url.replace(str(job), "987654").replace(str(art_id), "987654")
                                 .replace(ds, "ds_0000000000000000"), headers=auth(bob))
        assert theirs.status_code == missing.status_code == 404, url  # indistinguishable from a missing id
    for url in (f"/api/v1/jobs/{job}/cancel", f"/api/v1/jobs/{job}/retry"):
        assert env.client.post(url, headers=auth(bob)).status_code == 404
    assert env.client.get("/api/v1/jobs", headers=auth(bob)).json()["items"] == []
    assert env.client.get("/api/v1/jobs?owner=alice", headers=auth(bob)).json()["items"] == []
    assert env.client.get("/api/v1/datasets", headers=auth(bob)).json() == []
    assert [j["id"] for j in env.client.get("/api/v1/jobs?owner=alice", headers=auth(admin)).json()["items"]] == [job]
    assert [d["id"] for d in env.client.get("/api/v1/datasets", headers=auth(admin)).json()] == [ds]
    # bob cannot use alice's dataset in a spec either: it is "not found" (422 at the field)
    r = env.client.post("/api/v1/jobs", json={"spec": spec}, headers=auth(bob))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "spec", "dataset", "dataset_id"]
    assert env.client.get(f"/api/v1/jobs/{job}", headers=auth(alice)).json()["status"] == "queued"  # untouched


def test_non_admins_cannot_create_tokens_for_others(env: Any) -> None:
    alice, bob = env.token("alice"), env.token("bob")
    for body in ({"user": "bob"}, {"user": "root", "admin": True}, {"user": "alice", "admin": True}):
        r = env.client.post("/api/v1/tokens", json=body, headers=auth(alice))
        assert r.status_code == 403, body
    with env.session() as s:
        assert len(crud.list_tokens(s)) == 2  # nothing was created
    r = env.client.post("/api/v1/tokens", json={"user": "alice", "name": "ci"}, headers=auth(alice))
    assert r.status_code == 201  # one's own non-admin token is fine
    mine = r.json()
    assert env.client.get("/api/v1/users/me", headers=auth(mine["token"])).json()["is_admin"] is False
    assert {t["user"] for t in env.client.get("/api/v1/tokens", headers=auth(alice)).json()} == {"alice"}
    bobs = env.client.get("/api/v1/tokens", headers=auth(bob)).json()[0]["id"]
    assert env.client.delete(f"/api/v1/tokens/{bobs}", headers=auth(alice)).status_code == 404  # not 403
    assert env.client.get("/api/v1/users/me", headers=auth(bob)).status_code == 200
    assert env.client.delete(f"/api/v1/tokens/{mine['id']}", headers=auth(alice)).status_code == 200
    assert env.client.get("/api/v1/users/me", headers=auth(mine["token"])).status_code == 401


README = Path(__file__).resolve().parents[2] / "README.md"


def test_routes_open_without_a_token_are_the_documented_ones(env: Any) -> None:
    """/docs, /redoc and /openapi.json answered without a token while the README said every route but /healthz
    needs one. Every route outside the API that answers without a token is named in the README's trust model."""
    roles = README.read_text().split("- **Roles.**", 1)[1].split("\n- **", 1)[0]
    open_routes = []
    for route in env.client.app.routes:
        path = getattr(route, "path", "")
        if isinstance(route, APIRoute) or not path.startswith("/") or "{" in path or path in ("", "/"):
            continue
        if env.client.get(path).status_code == 200:
            open_routes.append(path)
    assert {"/docs", "/redoc", "/openapi.json"} <= set(open_routes), open_routes
    for path in open_routes:
        assert f"`{path}`" in roles or path.startswith("/docs/"), (path, roles)
    assert "`/healthz`" in roles
