"""Jobs API on SQLite and Postgres: auth, spec validation (422 naming the field), Idempotency-Key, enqueue after
commit (a message really on the broker), list filters and cursor pagination, ownership, cancel and retry."""

from __future__ import annotations

from fastapi.testclient import TestClient

from backend.lifecycle import JobStatus
from backend.persistence import crud
from tests.specs import api_spec
from worker.tlt.config import PRESETS

SPEC = api_spec(name="t", max_steps=2)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_auth_required(cp_client: TestClient, cp_backend) -> None:
    assert cp_client.get("/healthz").json() == {"status": "ok"}
    for method, path in [("get", "/api/v1/jobs"), ("post", "/api/v1/jobs"), ("get", "/metrics"),
                         ("get", "/api/v1/jobs/1/stream"), ("get", "/api/v1/datasets")]:
        r = getattr(cp_client, method)(path)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
    assert cp_client.get("/api/v1/jobs", headers=auth("tlt_wrong")).status_code == 401


def test_create_validates_and_enqueues(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    bad = {**SPEC, "algorithm": {"learning_rate": -1}}
    r = cp_client.post("/api/v1/jobs", json={"spec": bad}, headers=h)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "spec", "algorithm", "learning_rate"]
    r = cp_client.post("/api/v1/jobs", json={"spec": {**SPEC, "max_stepz": 3}}, headers=h)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "max_stepz"
    r = cp_client.post("/api/v1/jobs", json={"spec": {**SPEC, "dataset": {"dataset_id": "ds_nope"}}}, headers=h)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "spec", "dataset", "dataset_id"]
    assert cp_client.get("/api/v1/jobs", headers=h).json()["items"] == []  # nothing half-written
    assert cp_backend.queued_messages() == 0

    r = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "queued" and job["owner"] == "alice" and job["queue"] == "cpu"
    assert job["spec"]["algorithm"]["num_generations"] == 8  # defaults filled by JobSpec
    assert cp_backend.queued_messages("cpu") == 1
    events = cp_client.get(f"/api/v1/jobs/{job['id']}/events", headers=h).json()
    assert [(e["from_status"], e["to_status"]) for e in events] == [(None, "queued")]


def test_idempotency_key(cp_client: TestClient, cp_backend) -> None:
    h = {**auth(cp_backend.token()), "Idempotency-Key": "ci-run-42"}
    a = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h)
    b = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h)
    assert (a.status_code, b.status_code) == (201, 200)
    assert a.json()["id"] == b.json()["id"]
    assert cp_backend.queued_messages() == 1  # enqueued once
    c = cp_client.post("/api/v1/jobs", json={"spec": {**SPEC, "max_steps": 5}}, headers=h)
    assert c.status_code == 409 and "different spec" in c.json()["detail"]
    # the same key from another user is another job
    h2 = {**auth(cp_backend.token("bob")), "Idempotency-Key": "ci-run-42"}
    d = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h2)
    assert d.status_code == 201 and d.json()["id"] != a.json()["id"]


def test_list_filters_pagination_and_ownership(cp_client: TestClient, cp_backend) -> None:
    alice, bob, admin = (auth(cp_backend.token(u, admin=(u == "root"))) for u in ("alice", "bob", "root"))
    ids = [cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=alice).json()["id"] for _ in range(5)]
    bob_job = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=bob).json()["id"]
    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = cp_client.get("/api/v1/jobs", params=params, headers=alice).json()
        seen += [j["id"] for j in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == sorted(ids, reverse=True)  # newest first, no job twice, none of bob's
    assert cp_client.get(f"/api/v1/jobs/{bob_job}", headers=alice).status_code == 404
    assert cp_client.post(f"/api/v1/jobs/{bob_job}/cancel", headers=alice).status_code == 404
    assert cp_client.get(f"/api/v1/jobs/{bob_job}", headers=admin).status_code == 200
    everyone = cp_client.get("/api/v1/jobs", params={"limit": 100}, headers=admin).json()["items"]
    assert len(everyone) == 6
    only_bob = cp_client.get("/api/v1/jobs", params={"owner": "bob"}, headers=admin).json()["items"]
    assert [j["id"] for j in only_bob] == [bob_job]
    cp_client.post(f"/api/v1/jobs/{ids[0]}/cancel", headers=alice)
    cancelled = cp_client.get("/api/v1/jobs", params={"status": "cancelled"}, headers=alice).json()["items"]
    assert [j["id"] for j in cancelled] == [ids[0]]
    assert cp_client.get("/api/v1/jobs", params={"status": "nope"}, headers=alice).status_code == 422
    assert cp_client.get("/api/v1/jobs", params={"cursor": "garbage!"}, headers=alice).status_code == 400


def test_cancel_and_retry(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    job = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()
    r = cp_client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=h)
    assert r.json()["status"] == "cancelled" and r.json()["reason"] == "cancelled by alice"
    assert cp_client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=h).status_code == 409
    r = cp_client.post(f"/api/v1/jobs/{job['id']}/retry", headers=h)
    assert r.status_code == 200 and r.json()["status"] == "queued"
    assert cp_backend.queued_messages() == 2  # submit + retry
    # a running job goes to cancelling (the worker finishes the cancel)
    with cp_backend.session() as s:
        crud.transition(s, job["id"], JobStatus.starting, worker="w1", new_attempt=True)
        crud.transition(s, job["id"], JobStatus.running)
    r = cp_client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=h)
    assert r.json()["status"] == "cancelling"
    assert cp_client.post(f"/api/v1/jobs/{job['id']}/retry", headers=h).status_code == 409
    events = cp_client.get(f"/api/v1/jobs/{job['id']}/events", headers=h).json()
    assert [e["to_status"] for e in events] == [
        "queued", "cancelled", "queued", "starting", "running", "cancelling"]
    assert events[3]["worker"] == "w1" and events[3]["attempt"] == 1


def test_demo_preset_is_accepted(cp_client: TestClient, cp_backend) -> None:
    r = cp_client.post("/api/v1/jobs", json={"spec": PRESETS["demo-cpu"]}, headers=auth(cp_backend.token()))
    assert r.status_code == 201 and r.json()["name"] == PRESETS["demo-cpu"]["name"]


def test_broker_down_fails_job_with_503(cp_backend) -> None:
    from backend.core.config import Settings
    from backend.main import create_app

    settings = Settings(**{**cp_backend.settings.model_dump(), "broker_url": "redis://127.0.0.1:1/0",
                           "broker_timeout_s": 0.5})
    with TestClient(create_app(settings)) as client:
        h = auth(cp_backend.token())
        r = client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h)
        assert r.status_code == 503 and "could not be enqueued" in r.json()["detail"]
        job = client.get("/api/v1/jobs", headers=h).json()["items"][0]
        assert job["status"] == "failed" and "broker" in job["reason"]
